"""Conversion of Mamba conv state between SD and DS layouts and between TP shard counts."""
