"""SSH to one configured host for jobs: the same resolution and host-key rules as the poller
(``~/.ssh/config``, known_hosts enforced, ProxyJump), plus which processes are alive there.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

import asyncssh

from gputop.config import Config, HostConfig
from gputop.sources.ssh import JumpPool, known_hosts_for, resolve_options

#: ``ps`` prints only numbers and a state here: nothing a remote user chooses can forge a
#: row. A zombie (state Z: exited, not yet reaped by its parent) is not a running job.
PS_COMMAND = "exec ps -A -o pid= -o sid= -o stat="
MAX_PS_BYTES = 8 * 1024 * 1024


class JobHostError(Exception):
    """The host could not be asked (down, auth, timeout): its jobs' state is unknown."""


async def connect(config: Config, host: HostConfig,
                  jumps: JumpPool | None = None) -> tuple[asyncssh.SSHClientConnection,
                                                         JumpPool]:
    opts = resolve_options(host.address or host.name, ssh_config=config.ssh_config,
                           port=host.port, user=host.user)
    jumps = jumps or JumpPool(config.ssh_config)
    spec = opts.tunnel
    tunnel: Any = ()
    if isinstance(spec, str) and spec.lower() != "none":
        tunnel = await jumps.get(spec)
    conn = await asyncio.wait_for(asyncssh.connect(
        opts.host, opts.port, options=opts, tunnel=tunnel, known_hosts=known_hosts_for(opts),
        keepalive_interval=15, keepalive_count_max=3), config.timeout)
    return conn, jumps


@dataclass(frozen=True)
class Alive:
    """The processes on a host: pids and session ids."""

    pids: frozenset[int]
    sids: frozenset[int]

    def has(self, pid: int, session: bool) -> bool:
        return pid in (self.sids if session else self.pids)


def parse_ps(text: str) -> Alive:
    pids: set[int] = set()
    sids: set[int] = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 3 or not all(p.isdigit() and len(p) < 11 for p in parts[:2]) \
                or not parts[2].isascii() or len(parts[2]) > 16:
            raise ValueError(f"unexpected ps output: {line[:60]!r}")
        if parts[2].startswith("Z"):
            continue
        pids.add(int(parts[0]))
        sids.add(int(parts[1]))
    if not pids:
        raise ValueError("ps listed no processes")
    return Alive(frozenset(pids), frozenset(sids))


def alive_local() -> Alive:
    pids: set[int] = set()
    sids: set[int] = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            pid = int(name)
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    state = f.read(4096).rpartition(b")")[2].split()[:1]
                sid = os.getsid(pid)
            except OSError:
                continue
            if state == [b"Z"]:  # exited, not yet reaped: not running
                continue
            pids.add(pid)
            sids.add(sid)
    return Alive(frozenset(pids), frozenset(sids))


async def alive_on(config: Config, host: HostConfig) -> Alive:
    """Which processes run on ``host`` now; JobHostError if it cannot be asked."""
    if host.local:
        return await asyncio.to_thread(alive_local)
    try:
        conn, jumps = await connect(config, host)
    except (OSError, asyncssh.Error, asyncio.TimeoutError, ValueError) as exc:
        raise JobHostError(f"{host.name}: {exc or type(exc).__name__}") from None
    try:
        res = await asyncio.wait_for(conn.run(PS_COMMAND, encoding=None), config.timeout)
        out = res.stdout if isinstance(res.stdout, bytes) else b""
        if res.exit_status != 0 or len(out) > MAX_PS_BYTES:
            raise JobHostError(f"{host.name}: ps failed (exit {res.exit_status})")
        return parse_ps(out.decode("ascii", "replace"))
    except (OSError, asyncssh.Error, asyncio.TimeoutError, ValueError) as exc:
        raise JobHostError(f"{host.name}: {exc or type(exc).__name__}") from None
    finally:
        conn.close()
        await jumps.close()
