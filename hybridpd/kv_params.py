"""The ``kv_transfer_params`` of vLLM's NixlConnector that a client of a P/D pair sends to P.

One constant shared by the proxy (``hybridpd.launch.proxy.protocol``) and `verify`'s live probes
(``hybridpd.verify.live``): a module of its own so that the verifier does not import the proxy package
(and aiohttp with it).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

#: ``kv_transfer_params`` sent to P: "prefill only, a remote instance will decode".
PREFILL_KV_TRANSFER_PARAMS: Final[Mapping[str, Any]] = MappingProxyType(
    {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
)
