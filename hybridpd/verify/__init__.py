"""Proof that what moved is what should have moved: NIXL rehearsal and live deployments."""
