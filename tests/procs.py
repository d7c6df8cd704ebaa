"""Process and port helpers shared by the serve and supervisor tests (Linux /proc)."""

from __future__ import annotations

import socket
from pathlib import Path


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (all sockets held open until every port is chosen)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()
    return ports


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
