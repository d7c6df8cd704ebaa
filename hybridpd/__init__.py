"""hybridpd: plan, launch and verify disaggregated prefill/decode for hybrid SSM models on vLLM.

The library never imports click, rich, torch, nixl or vllm at import time; the CLI lives in ``cli/``.
"""

__version__ = "0.1.0"
