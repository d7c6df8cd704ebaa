"""Launching P/D pairs: vllm serve command lines, the supervisor, the proxy, Kubernetes manifests."""
