"""ucx_bench.py -- NIXL/UCX READ of GPU memory between two processes on one GPU (issue #30 item 3).

  python ucx_bench.py both [--sizes 4096,65536,1048576,4194304,67108864] [--iters 5] [--port 27900]

`both` starts a "prefill" process that owns a 256 MiB VRAM region (random bytes, seeded) and a "decode" process
that READs from it into its own VRAM region, as vLLM's NixlConnector does (D pulls from P). For each descriptor
size S: n = min(64 MiB / S, 2048) descriptors, 2 S apart in both regions (never adjacent, so nothing can merge
them), prepped once; each READ is make_prepped_xfer + transfer + poll to DONE, timed by the caller; one untimed
warm-up READ first, then --iters timed ones. Bytes are checked on the GPU after the last READ.
Prints one JSON line per size: {"size", "n", "bytes", "best_s", "median_s", "median_gbps", "best_gbps", "ok"}.
UCX is configured only by the environment the caller gives (ucx.sh sets one configuration per run).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import statistics
import struct
import subprocess
import sys
import time

MiB = 1 << 20
REGION = 256 * MiB


def send(sock: socket.socket, obj: object) -> None:
    data = pickle.dumps(obj)
    sock.sendall(struct.pack("!Q", len(data)) + data)


def recv(sock: socket.socket) -> object:
    def exact(n: int) -> bytes:
        b = bytearray()
        while len(b) < n:
            c = sock.recv(min(1 << 20, n - len(b)))
            if not c:
                raise EOFError
            b += c
        return bytes(b)
    (n,) = struct.unpack("!Q", exact(8))
    return pickle.loads(exact(n))


def region(fill: bool, device: str):
    import torch

    if fill:
        g = torch.Generator(device=device).manual_seed(11)
        return torch.randint(0, 256, (REGION,), dtype=torch.uint8, device=device, generator=g)
    return torch.zeros(REGION, dtype=torch.uint8, device=device)


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def descs(base: int, size: int, n: int):
    import numpy as np

    arr = np.empty((n, 3), dtype=np.uint64)
    arr[:, 0] = np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(2 * size)
    arr[:, 1] = size
    arr[:, 2] = 0
    return arr


def prefill(a: argparse.Namespace) -> None:
    ag = agent("prefill")
    src = region(True, a.device)
    reg = ag.register_memory(src)
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", a.port))
    srv.listen(1)
    conn, _ = srv.accept()
    ag.add_remote_agent(recv(conn))
    send(conn, {"md": ag.get_agent_metadata(), "base": src.data_ptr()})
    recv(conn)  # decode says it is done
    ag.deregister_memory(reg)


def decode(a: argparse.Namespace) -> int:
    import numpy as np
    import torch

    ag = agent("decode")
    dst = region(False, a.device)
    reg = ag.register_memory(dst)
    expect = region(True, a.device)
    mem = "VRAM" if a.device == "cuda" else "DRAM"
    sock = None
    t = time.monotonic()
    while sock is None:
        try:
            sock = socket.create_connection(("127.0.0.1", a.port), timeout=60)
        except ConnectionRefusedError:
            if time.monotonic() - t > 60:
                raise
            time.sleep(0.1)
    send(sock, ag.get_agent_metadata())
    msg = recv(sock)
    remote = ag.add_remote_agent(msg["md"])
    bad = 0
    for size in (int(x) for x in a.sizes.split(",")):
        n = max(1, min((64 * MiB) // size, 2048))
        lh = ag.prep_xfer_dlist("NIXL_INIT_AGENT", descs(dst.data_ptr(), size, n), mem)
        rh = ag.prep_xfer_dlist(remote, descs(msg["base"], size, n), mem)
        idx = np.arange(n, dtype=np.int32)
        dst.zero_()
        sync(a.device)
        times = []
        for it in range(a.iters + 1):
            t = time.perf_counter()
            h = ag.make_prepped_xfer("READ", lh, idx, rh, idx)
            st = ag.transfer(h)
            while st == "PROC":
                st = ag.check_xfer_state(h)
            dt = time.perf_counter() - t
            ag.release_xfer_handle(h)
            if st != "DONE":
                raise RuntimeError(f"READ ended {st}")
            if it:
                times.append(dt)
        sync(a.device)
        got = dst[: n * 2 * size].view(n, 2 * size)[:, :size]
        want = expect[: n * 2 * size].view(n, 2 * size)[:, :size]
        ok = bool(torch.equal(got, want))
        bad += not ok
        nbytes = n * size
        med, best = statistics.median(times), min(times)
        print(json.dumps({"size": size, "n": n, "bytes": nbytes, "best_s": best, "median_s": med,
                          "median_gbps": round(nbytes / med / 1e9, 3), "best_gbps": round(nbytes / best / 1e9, 3),
                          "iters": a.iters, "ok": ok, "device": a.device}), flush=True)
        ag.release_dlist_handle(lh)
        ag.release_dlist_handle(rh)
    send(sock, "done")
    ag.remove_remote_agent(remote)
    ag.deregister_memory(reg)
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["both", "prefill", "decode"])
    ap.add_argument("--sizes", default="4096,65536,1048576,4194304,67108864")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--port", type=int, default=27900)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: DRAM, for a rehearsal")
    a = ap.parse_args()
    if a.role == "both":
        me = [sys.executable, os.path.abspath(__file__)]
        rest = sys.argv[2:]
        p = subprocess.Popen(me + ["prefill", *rest])
        d = subprocess.Popen(me + ["decode", *rest])
        rc_d = d.wait(timeout=300)
        rc_p = p.wait(timeout=60)
        sys.exit(rc_d or rc_p)
    if a.role == "prefill":
        prefill(a)
    else:
        sys.exit(decode(a))


if __name__ == "__main__":
    main()
