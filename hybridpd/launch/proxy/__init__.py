"""P/D routing proxy for vLLM + NixlConnector: clients talk OpenAI to it, it runs prefill on a P instance and
relays decode from a D instance (see ``hybridpd.launch.proxy.app`` for the design and the error mapping).

Public API::

    from hybridpd.launch.proxy import ProxyConfig, build_app, run_proxy
    run_proxy(ProxyConfig(prefill_urls=("http://127.0.0.1:8100",), decode_urls=("http://127.0.0.1:8200",)))

or, from the command line, ``hybridpd proxy --prefill URL --decode URL``.
"""

from hybridpd.launch.proxy.app import ProxyState, build_app, proxy_state
from hybridpd.launch.proxy.config import POLICIES, Policy, ProxyConfig, ProxyConfigError
from hybridpd.launch.proxy.errors import ProxyError
from hybridpd.launch.proxy.pool import Backend, BackendPool
from hybridpd.launch.proxy.protocol import (
    PREFILL_KV_TRANSFER_PARAMS,
    REQUIRED_KV_KEYS,
    RESTORED_FIELDS,
    SSEFramer,
    decode_request,
    fields_to_restore,
    kv_transfer_params_from_prefill,
    prefill_request,
    validate_client_request,
)
from hybridpd.launch.proxy.server import make_runner, make_site, run_proxy, serve_proxy

__all__ = [
    "POLICIES",
    "PREFILL_KV_TRANSFER_PARAMS",
    "REQUIRED_KV_KEYS",
    "RESTORED_FIELDS",
    "Backend",
    "BackendPool",
    "Policy",
    "ProxyConfig",
    "ProxyConfigError",
    "ProxyError",
    "ProxyState",
    "SSEFramer",
    "build_app",
    "make_runner",
    "make_site",
    "decode_request",
    "fields_to_restore",
    "kv_transfer_params_from_prefill",
    "prefill_request",
    "proxy_state",
    "run_proxy",
    "serve_proxy",
    "validate_client_request",
]
