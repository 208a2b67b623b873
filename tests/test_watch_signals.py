"""``--json --watch`` on the real-sshd fleet: one blackholed host never holds the others
back, and SIGTERM/SIGHUP/SIGINT end it cleanly, with no refresh left running on a host."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from tests.support.fleet import Fleet, Host
from tests.support.shared_fleet import need_sshd, world_readable


@pytest.fixture
def hang_fleet(tmp_path: Path) -> Iterator[Fleet]:
    """A healthy host between two whose nvidia-smi never returns (first, middle, last)."""
    need_sshd()
    f = Fleet(world_readable(tmp_path), [
        Host("hang-a", "127.0.3.2", scenario="hang"),
        Host("fast", "127.0.3.3", gpus=("l40s", "h100")),
        Host("hang-z", "127.0.3.4", scenario="hang"),
    ]).start()
    yield f
    f.stop()


def start(fleet: Fleet, timeout: float, interval: float) -> subprocess.Popen[str]:
    cfg = fleet.write_config(timeout=timeout, interval=interval)
    return subprocess.Popen(
        [sys.executable, "-m", "gputop", "--json", "--watch", "--config", str(cfg)],
        env=fleet.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def when(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def wait_for(check: object, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_a_blackholed_host_never_delays_the_documents(hang_fleet: Fleet) -> None:
    proc = start(hang_fleet, timeout=3.0, interval=1.0)
    assert proc.stdout is not None
    try:
        docs, arrived = [], []
        while len(docs) < 6:
            line = proc.stdout.readline()
            assert line, proc.stderr.read() if proc.stderr else ""
            docs.append(json.loads(line))
            arrived.append(time.monotonic())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    gaps = [b - a for a, b in itertools.pairwise(arrived[1:])]
    # One document per interval (1 s), not one per hung query (3 s).
    assert max(gaps) < 1.8, gaps
    for doc in docs:
        hosts = {h["name"]: h for h in doc["hosts"]}
        assert [h["name"] for h in doc["hosts"]] == ["hang-a", "fast", "hang-z"]
        fast = hosts["fast"]
        assert fast["status"] == "ok" and len(fast["gpus"]) == 2
        # Healthy data is at most about one interval old, never a hung query's timeout.
        assert (when(doc["time"]) - when(fast["time"])).total_seconds() <= 2.0, doc
        for name in ("hang-a", "hang-z"):
            assert hosts[name]["status"] == "error"
            assert hosts[name]["error"]["kind"] == "timeout"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_ends_watch_and_every_remote_refresh(hang_fleet: Fleet, sig: int) -> None:
    proc = start(hang_fleet, timeout=60.0, interval=1.0)
    hosts = [hang_fleet.hosts["hang-a"], hang_fleet.hosts["hang-z"]]
    try:
        # Both hung refreshes are in flight on their hosts.
        assert wait_for(lambda: all(hang_fleet.remote_processes(h) for h in hosts), 30)
        proc.send_signal(sig)
        proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == 128 + sig, stderr
    assert "Traceback" not in stderr
    for h in hosts:  # killed on the host, not orphaned there (a zombie may take a moment)
        assert wait_for(lambda h=h: not hang_fleet.remote_processes(h), 3), \
            hang_fleet.remote_processes(h)


async def test_close_kills_a_refresh_still_in_flight(hang_fleet: Fleet,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Shutdown may close a source while its query task is still waiting (the board's
    worker is cancelled and the loop torn down): closing stdin alone would leave the hung
    nvidia-smi running on the host."""
    import asyncio
    import contextlib

    from gputop.config.load import load_config
    from gputop.poller import Poller

    monkeypatch.setenv("HOME", str(hang_fleet.home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    config = load_config(str(hang_fleet.write_config(["hang-z"], timeout=60.0)))
    poller = Poller(config)
    (source,) = poller.sources
    host = hang_fleet.hosts["hang-z"]
    query = asyncio.create_task(source.query())
    try:
        for _ in range(600):
            if hang_fleet.remote_processes(host):
                break
            await asyncio.sleep(0.05)
        assert hang_fleet.remote_processes(host)
        await source.close()
        for _ in range(60):
            if not hang_fleet.remote_processes(host):
                break
            await asyncio.sleep(0.05)
        assert not hang_fleet.remote_processes(host)
    finally:
        query.cancel()
        with contextlib.suppress(BaseException):
            await query
        await poller.aclose()
