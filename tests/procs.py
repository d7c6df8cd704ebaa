"""Process and port helpers shared by the serve and supervisor tests (Linux /proc)."""

from __future__ import annotations

import socket
from pathlib import Path


def _server_port_range() -> range:
    """Ports below the kernel's ephemeral range: a server port picked there cannot be taken meanwhile as the
    source port of some outgoing connection (a restarted engine's NIXL side channel failed that way)."""
    try:
        lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        lo = 32768
    return range(10000, max(10001, lo))


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports outside the ephemeral range (all held open until every one is chosen)."""
    import random

    span = _server_port_range()
    socks: list[socket.socket] = []
    try:
        while len(socks) < n:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", random.choice(span)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def group_members(pgid: int) -> list[int]:
    """Pids whose process group is ``pgid``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[3]) == pgid:
                out.append(int(d.name))
    return out


def free_port_run(n: int, tries: int = 200) -> int:
    """A base port such that base .. base+n-1 are all free (side channels use base + instance index)."""
    for _ in range(tries):
        base = free_ports(1)[0]
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports found")
