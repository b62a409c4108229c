"""The processes a test started, for tests that kill -9 (or signal) a run and check nothing is left behind, and
the sockets they listen on."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """PIDs of every process below ``pid`` (torchrun starts its ranks in sessions of their own: killpg misses
    them), for tests that kill -9 a run."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie holds nothing: whoever adopted it reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def listening(pid: int) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on, from /proc (an IPv4 address mapped into
    IPv6 given as the IPv4 one)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            host, port = fields[1].split(":")
            raw = b"".join(bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8))  # host order words
            addr = ipaddress.ip_address(raw)
            if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
                addr = addr.ipv4_mapped
            out.append((addr, int(port, 16)))
    return out
