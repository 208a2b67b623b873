"""Round-4 hostile review of the streaming client path (callbacks, one alarm, no
keepalive, paced --watch). Each test names the finding it reproduces."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import _need_sshd, _world_readable
from fleet import Fleet, Host

from gputop.config import load_config
from gputop.poller import Poller
from gputop.sources.ssh import SshSource
from gputop.sources.stream import HostSession

INTERVAL = 0.5
TIMEOUT = 2.0


@pytest.fixture
def rfleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fleet]:
    _need_sshd()
    f = Fleet(_world_readable(tmp_path), [
        Host("alpha", "127.0.6.12", gpus=("h100", "l40s")),
    ]).start()
    monkeypatch.setenv("HOME", str(f.home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    yield f
    f.stop()


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    kids: list[int] = []
    for ln in out.splitlines():
        p, pp = (int(x) for x in ln.split())
        if pp == pid:
            kids.append(p)
    return kids


def _sshd_tree(root: int) -> list[int]:
    """Every sshd process below the listening one (the connections' sshd children)."""
    out, todo = [], _children(root)
    while todo:
        p = todo.pop()
        comm = subprocess.run(["ps", "-o", "comm=", "-p", str(p)], capture_output=True,
                              text=True).stdout.strip()
        if comm.startswith("sshd"):
            out.append(p)
            todo.extend(_children(p))
    return out


async def test_a_frozen_connection_is_dropped_and_the_host_comes_back(rfleet: Fleet) -> None:
    """Finding: no keepalive on streaming connections (sources/ssh.py _connect) and a
    stream stall keeps the connection (kind "timeout" is not dropped), so a connection
    whose peer went silent without a FIN/RST (sshd hung, conntrack/NAT state lost) is
    reused for ever: every restart opens a channel on it and times out. The host never
    answers again, though a fresh connection works at once. (Before: asyncssh's keepalive
    closed it after about 3 x 30 s.)"""
    alpha = rfleet.hosts["alpha"]
    cfg = rfleet.write_config(["alpha"], timeout=TIMEOUT, interval=INTERVAL,
                              first_sample_timeout=3.0)
    poller = Poller(load_config(str(cfg)))
    src = poller.sources[0]
    assert isinstance(src, SshSource) and src.streaming
    frozen: list[int] = []
    kinds: list[str] = []
    frozen_at = 0.0
    back_after: float | None = None
    try:
        started = time.monotonic()
        async for snap in poller.updates():
            kinds.append(snap.error.kind if snap.error else "ok")
            if not frozen and kinds.count("ok") >= 2:
                assert alpha.proc is not None
                frozen = _sshd_tree(alpha.proc.pid)  # this connection's sshd: silent
                assert frozen
                for p in frozen:
                    os.kill(p, signal.SIGSTOP)
                frozen_at = time.monotonic()
            elif frozen and "timeout" in kinds and kinds[-1] == "ok":
                back_after = time.monotonic() - frozen_at
                break
            if time.monotonic() - started > 40:
                break
    finally:
        await poller.aclose()
        for p in frozen:
            os.kill(p, signal.SIGCONT)
    assert back_after is not None, (kinds[-8:], src.connects)
    assert back_after < 20, back_after
    assert src.connects == 2
