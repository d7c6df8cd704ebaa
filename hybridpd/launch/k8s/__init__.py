"""Kubernetes and llm-d manifests for a P/D pair."""
