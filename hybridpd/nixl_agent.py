"""One NIXL agent per rank, each in its own process (multiprocessing spawn), UCX over loopback, DRAM.

Prefill ranks fill their KV-cache tensors, register them and serve (polling notifications: agents run
without a progress thread, see nixl-notes gotchas 1-2).  Decode ranks register theirs, add the P
agents' metadata, prep the descriptor views exactly as vLLM does (``prep_xfer_dlist`` over the full
tables, ``make_prepped_xfer`` with the request's desc ids, one READ per source P rank) and check the
result in-process (``rehearsal.rank_result``).  The parent only relays metadata and collects verdicts.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

from .errors import ExternalToolError
from .rehearsal import Setup

TIMEOUT_S = 180.0


def _env() -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")


def import_nixl() -> tuple[Any, Any]:
    """(nixl_agent, nixl_agent_config) without importing torch when possible."""
    _env()
    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[no-redef]
        except ImportError as e:
            raise ExternalToolError(f"NIXL is not installed ({e})",
                                    fix="pip install --no-deps nixl-cu13==1.5.1 nixl==1.5.1") from None
    return nixl_agent, nixl_agent_config


def nixl_available() -> bool:
    try:
        import_nixl()
    except ExternalToolError:
        return False
    return True


def _agent(name: str) -> Any:
    nixl_agent, nixl_agent_config = import_nixl()
    cfg = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, capture_telemetry=True,
                            backends=["UCX"])
    return nixl_agent(name, cfg)


def _register(agent: Any, tensors: list[Any]) -> Any:
    return agent.register_memory([(t.ctypes.data, t.nbytes, 0, "") for t in tensors], "DRAM")


def _prefill_main(setup: Setup, rank: int, conn: Any) -> None:
    try:
        from .rehearsal import fill_prefill

        tensors = fill_prefill(setup, rank)
        agent = _agent(f"p{rank}")
        reg = _register(agent, tensors)
        conn.send(("ready", agent.get_agent_metadata(), [t.ctypes.data for t in tensors]))
        notifs: list[tuple[str, bytes]] = []
        t0 = time.monotonic()
        while True:
            for k, msgs in agent.get_new_notifs().items():
                notifs.extend((str(k), m) for m in msgs)
            if conn.poll():
                conn.recv()
                break
            if time.monotonic() - t0 > TIMEOUT_S:
                break
            time.sleep(0.0002)
        agent.deregister_memory(reg)
        conn.send(("done", [(k, m.decode(errors="replace")) for k, m in notifs]))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        conn.send(("error", traceback.format_exc()))


def _telemetry(agent: Any, handle: Any) -> dict[str, int] | None:
    try:
        t = agent.get_xfer_telemetry(handle)
        return {"bytes": int(t.totalBytes), "descriptors": int(t.descCount), "xfer_us": int(t.xferDuration)}
    except Exception:  # noqa: BLE001 - telemetry is optional
        return None


def _decode_main(setup: Setup, rank: int, conn: Any, repeat: int = 1) -> None:
    try:
        from .rehearsal import init_decode, rank_result, transfer_views

        tensors = init_decode(setup)
        agent = _agent(f"d{rank}")
        reg = _register(agent, tensors)
        conn.send(("ready", None, [t.ctypes.data for t in tensors]))
        kind, p_info = conn.recv()
        assert kind == "peers"
        names = {pr: agent.add_remote_agent(md) for pr, (md, _) in p_info.items()}
        p_bases = {pr: bases for pr, (_, bases) in p_info.items()}
        d_bases = [t.ctypes.data for t in tensors]
        views = transfer_views(setup, rank, p_bases, d_bases)
        times = []
        for it in range(max(1, repeat)):
            tel, have_tel, elapsed = _read_once(agent, names, views, rank, last=it == max(1, repeat) - 1)
            times.append(elapsed)
        res = rank_result(setup, rank, views, tensors, p_bases, telemetry=tel if have_tel else None,
                          elapsed_s=times[-1])
        res["first_elapsed_s"] = times[0]
        for n in names.values():
            agent.remove_remote_agent(n)
        agent.deregister_memory(reg)
        conn.send(("result", res))
    except BaseException:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))


def _read_once(agent: Any, names: dict[int, Any], views: list[Any], rank: int,
               last: bool) -> tuple[dict[str, int], bool, float]:
    """One READ per source P rank (as vLLM), all posted before waiting; returns telemetry and seconds."""
    import numpy as np

    tel = {"bytes": 0, "descriptors": 0, "xfer_us": 0}
    have_tel = True
    t0 = time.perf_counter()
    handles = []
    for v in views:
        def nx3(tab: Any) -> Any:
            a = np.zeros((len(tab), 3), dtype=np.uint64)
            a[:, 0], a[:, 1] = tab.addr, tab.length
            return a

        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", nx3(v.local), "DRAM")
        rh = agent.prep_xfer_dlist(names[v.p_rank], nx3(v.remote), "DRAM")
        h = agent.make_prepped_xfer("READ", lh, v.local_ids.astype(np.int32), rh, v.remote_ids.astype(np.int32),
                                    f"d{rank}-done".encode() if last else b"")
        st = agent.transfer(h)
        handles.append((h, lh, rh, st))
    for h, _lh, _rh, st in handles:
        t1 = time.monotonic()
        while st == "PROC":
            st = agent.check_xfer_state(h)
            if time.monotonic() - t1 > 60:
                raise TimeoutError("NIXL READ still in progress after 60 s")
        if st != "DONE":
            raise RuntimeError(f"NIXL READ ended in state {st}")
        t = _telemetry(agent, h)
        if t is None:
            have_tel = False
        else:
            for k in tel:
                tel[k] += t[k]
    elapsed = time.perf_counter() - t0
    for h, lh, rh, _ in handles:
        agent.release_xfer_handle(h)
        agent.release_dlist_handle(lh)
        agent.release_dlist_handle(rh)
    return tel, have_tel, elapsed


def _recv(conn: Any, who: str, deadline: float) -> tuple[Any, ...]:
    left = deadline - time.monotonic()
    if left <= 0 or not conn.poll(left):
        raise ExternalToolError(f"{who} did not answer within {TIMEOUT_S:.0f} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise ExternalToolError(f"{who} failed:\n{msg[1]}")
    return msg


def run_nixl(setup: Setup, *, repeat: int = 1) -> list[dict[str, Any]]:
    """Spawn P and D rank processes, run the READs, return the per-D-rank verdicts."""
    import multiprocessing as mp

    import_nixl()  # fail early, in the parent, with the install hint
    _env()
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    p_conns, d_conns = {}, {}
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for r in range(setup.p.tp):
            a, b = ctx.Pipe()
            pr = ctx.Process(target=_prefill_main, args=(setup, r, b), daemon=True)
            pr.start()
            procs.append(pr)
            p_conns[r] = a
        for r in range(setup.d.tp):
            a, b = ctx.Pipe()
            pr = ctx.Process(target=_decode_main, args=(setup, r, b, repeat), daemon=True)
            pr.start()
            procs.append(pr)
            d_conns[r] = a
        p_info = {}
        for r, c in p_conns.items():
            _, md, bases = _recv(c, f"prefill rank {r}", deadline)
            p_info[r] = (md, bases)
        for r, c in d_conns.items():
            _recv(c, f"decode rank {r}", deadline)
        assert setup.plan.routes is not None
        for r, c in d_conns.items():
            need = {s.p_rank for s in setup.plan.routes[r].sources}
            c.send(("peers", {pr: p_info[pr] for pr in need}))
        results = [_recv(c, f"decode rank {r}", deadline)[1] for r, c in d_conns.items()]
        for c in p_conns.values():
            c.send("stop")
        for r, c in p_conns.items():
            _recv(c, f"prefill rank {r}", deadline)
        return results
    finally:
        for pr in procs:
            pr.join(timeout=10)
            if pr.is_alive():
                pr.terminate()
                pr.join(timeout=5)
