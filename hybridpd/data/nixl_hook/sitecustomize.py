"""hybridpd's startup hook for vLLM processes that `hybridpd serve` launches with NIXL progress-thread pacing.

`serve` puts this directory on PYTHONPATH of P and D (and so of EngineCore and its workers) when
``--nixl-progress-delay-us`` is above 0. NIXL's agent config has a progress-thread pacing field
(``nixlAgentConfig.pthrDelay``, microseconds: the UCX backend's shared progress thread polls its workers with
that timeout), but NIXL's Python wrapper (``nixl_agent.__init__``, NIXL 0.x-1.5) always sets it to 0, which makes
that thread spin a whole core while idle, one per agent; vLLM (0.20-0.33) exposes no setting for it. This hook
sets the field to ``$HYBRIDPD_NIXL_PTHR_DELAY_US`` for every agent the process creates, and changes nothing else.
Nothing in the vLLM venv is modified. A sitecustomize already on the path runs after this one, as before.
"""

import importlib.abc
import importlib.util
import os
import sys
from typing import Any

_DIR = os.path.dirname(os.path.abspath(__file__))


def _delay() -> int:
    try:
        return max(0, int(os.environ.get("HYBRIDPD_NIXL_PTHR_DELAY_US", "0")))
    except ValueError:
        return 0


def _patch(mod: Any) -> None:
    orig: Any = getattr(mod, "nixlAgent", None)
    if orig is None or getattr(orig, "_hybridpd_paced", False):
        return
    delay = _delay()

    class nixlAgent(orig):  # noqa: N801 - keeps the binding's name
        _hybridpd_paced = True

        def __init__(self, name, cfg, *a, **kw):
            try:
                cfg.pthrDelay = delay
            except AttributeError:
                pass
            super().__init__(name, cfg, *a, **kw)

    mod.nixlAgent = nixlAgent


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        top, _, last = fullname.partition(".")
        if last != "_bindings" or not top.startswith("nixl"):
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader

        class _Loader(importlib.abc.Loader):
            def create_module(self, s):
                return loader.create_module(s)

            def exec_module(self, module):
                loader.exec_module(module)
                _patch(module)

        spec.loader = _Loader()
        return spec


if _delay() > 0:
    sys.meta_path.insert(0, _Finder())

# run the sitecustomize this one shadows, if any
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _DIR]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None and os.path.dirname(os.path.abspath(_spec.origin or "")) != _DIR:
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
