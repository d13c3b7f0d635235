"""Free TCP ports for the servers the tests start (a process group's store, torchrun's master, SLURM's daemons)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

FIRST = 30000
"""Ports are drawn from FIRST up to the kernel's ephemeral range: above launch/slurm.sbatch's rendezvous ports
(15000-29999), below what the kernel hands out itself."""


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port() -> int:
    """A port free now, for a server that binds it a moment later. A port the kernel picks (bind to port 0) comes
    from its ephemeral range, which it also hands to outgoing connections (gloo opens many per process group): in
    the moment between the choice and the bind another process's connection can take it, and the server fails
    with EADDRINUSE (seen in a full run). So the port is drawn below that range where there is room; else the
    kernel picks."""
    end = _ephemeral_start()
    draw = random.SystemRandom()  # not the tests' seeded random: workers must not draw the same ports
    for _ in range(200):
        port = draw.randrange(FIRST, end) if end > FIRST + 100 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken: draw again
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port in {FIRST}-{end - 1}")
