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


def _sessions(fleet: Fleet, h: Host) -> set[int]:
    out: set[int] = set()
    for ln in fleet.remote_processes(h):
        sid = subprocess.run(["ps", "-o", "sid=", "-p", ln.split()[0]], capture_output=True,
                             text=True).stdout.strip()
        if sid:
            out.add(int(sid))
    return out


def _session_pids(sid: int) -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout
    return {int(p) for p, s in (ln.split() for ln in out.splitlines()) if int(s) == sid}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_paced_and_ps_hangs_leaves_nothing_on_the_host(
    rfleet: Fleet, sig: int,
) -> None:
    """--json --watch paces its loop once every host answered (0.25 s at a 2 s interval):
    a signal then, while a ps the session asked for hangs, must still end the process
    cleanly and kill the session's process group on the host."""
    import sys

    from fleet import GpuProcess
    alpha = rfleet.hosts["alpha"]
    flag = rfleet.root / "alpha" / "ps-hangs"
    ps = rfleet.root / "alpha" / "bin" / "ps"
    ps.write_text(ps.read_text().replace(
        "exec /bin/ps", f"[ -e {flag} ] && exec sleep 600\nexec /bin/ps"))
    cfg = rfleet.write_config(["alpha"], timeout=20.0, interval=2.0)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gputop", "--json", "--watch", "--config", str(cfg)],
        env=rfleet.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    sids: set[int] = set()
    try:
        for _ in range(2):  # paced from the first document on
            assert proc.stdout.readline()
        sids = _sessions(rfleet, alpha)
        assert len(sids) == 1
        flag.write_text("")
        newcomer = GpuProcess("gtbob", "python eval.py", gpu=1)
        rfleet.start_process(newcomer)
        alpha.processes.append(newcomer)
        rfleet.set_scenario(alpha, "ok")
        deadline = time.monotonic() + 10
        while not any(c.startswith("ps ") and str(newcomer.pid) in c
                      for c in rfleet.calls(alpha)):
            assert time.monotonic() < deadline, rfleet.calls(alpha)
            time.sleep(0.05)
        time.sleep(0.3)  # the ps is hanging on the host
        sent = time.monotonic()
        proc.send_signal(sig)
        proc.wait(20)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
        flag.unlink(missing_ok=True)
    stderr = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == 128 + sig, stderr
    assert "Traceback" not in stderr, stderr
    assert took < 3.0, took
    (sid,) = sids
    deadline = time.monotonic() + 3
    while _session_pids(sid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _session_pids(sid) == set(), subprocess.run(
        ["ps", "-o", "pid,args", "-s", str(sid)], capture_output=True, text=True).stdout


def _watch(fleet: Fleet, cfg: Path, pace: float | None) -> subprocess.Popen[str]:
    """``gputop --json --watch``; ``pace``: override cli.WATCH_PACE_S (None: as shipped)."""
    import sys
    code = ("import sys, gputop.cli as c\n"
            + (f"c.WATCH_PACE_S = {pace!r}\n" if pace is not None else "")
            + "sys.exit(c.main(sys.argv[1:]))")
    return subprocess.Popen(
        [sys.executable, "-c", code, "--json", "--watch", "--config", str(cfg)],
        env=fleet.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[1])


@pytest.mark.parametrize("pace", [None, 0.0], ids=["paced", "unpaced"])
def test_a_dropped_host_reconnects_within_its_timeout_while_paced(
    rfleet: Fleet, pace: float | None,
) -> None:
    """Finding: once --json --watch paces its loop (min(0.25 s, interval/8)), every
    dependent round trip waits for the next paced poll, so an SSH handshake (banner, kex,
    newkeys, service, three auth steps, channel open, exec, start line: ~10 round trips)
    takes ~2.5 s however close the host is. A host whose connection drops must connect
    again within its `timeout`; at interval 2 s and timeout 2 s it never does while paced
    (and at any interval, the pace eats timeout / pace round trips of the handshake)."""
    import json
    alpha = rfleet.hosts["alpha"]
    cfg = rfleet.write_config(["alpha"], timeout=2.0, interval=2.0)
    proc = _watch(rfleet, cfg, pace)
    assert proc.stdout is not None
    statuses: list[str] = []
    try:
        for _ in range(2):
            doc = json.loads(proc.stdout.readline())
            assert doc["hosts"][0]["status"] == "ok", doc
        assert alpha.proc is not None
        for p in _sshd_tree(alpha.proc.pid):  # the connection drops (its sshd is killed)
            os.kill(p, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            h = json.loads(proc.stdout.readline())["hosts"][0]
            statuses.append(h["status"] if h["status"] == "ok" else h["error"]["kind"]
                            + ": " + h["error"]["message"][:60])
            if len(statuses) > 1 and statuses[-1] == "ok":
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    assert statuses and statuses[-1] == "ok", statuses


async def test_changed_still_returns_after_its_timeout_when_the_session_is_closed() -> None:
    """Finding: HostSession.changed's one alarm is cancelled by close() (and kill()), but
    the waiters are neither woken nor re-armed: one waiting then never returns (before,
    each waiter's own timer ended its wait at the timeout)."""
    st = HostSession(None, 0.5, 1 << 20)  # type: ignore[arg-type]  # changed() needs no conn
    waiting = asyncio.ensure_future(st.changed(0.2))
    await asyncio.sleep(0.05)
    st.close()
    await asyncio.wait_for(waiting, 2.0)


async def test_many_session_restarts_leave_no_channels_timers_tasks_or_processes(
    rfleet: Fleet,
) -> None:
    """The GPU loop is killed on the host again and again: each time the session ends and
    is restarted on the same connection. Nothing of the old sessions may pile up: asyncssh
    channels, loop timers, tasks, sessions on the host."""
    alpha = rfleet.hosts["alpha"]
    cfg = rfleet.write_config(["alpha"], timeout=TIMEOUT, interval=INTERVAL)
    poller = Poller(load_config(str(cfg)))
    src = poller.sources[0]
    assert isinstance(src, SshSource)
    loop = asyncio.get_running_loop()
    kinds: list[str] = []
    marks: list[tuple[int, int, int, int]] = []
    oks_since_kill = 0
    try:
        async for snap in poller.updates():
            kinds.append(snap.error.kind if snap.error else "ok")
            oks_since_kill = oks_since_kill + 1 if snap.error is None else 0
            if oks_since_kill >= 3:
                conn = src._conn
                assert conn is not None
                marks.append((len(conn._channels), len(loop._scheduled),  # type: ignore[attr-defined]
                              len(asyncio.all_tasks()), len(_sessions(rfleet, alpha))))
                if len(marks) == 10:
                    break
                gpu = [ln for ln in rfleet.remote_processes(alpha) if "--query-gpu" in ln]
                assert len(gpu) == 1, gpu
                os.kill(int(gpu[0].split()[0]), signal.SIGKILL)
                oks_since_kill = 0
            assert len(kinds) < 400, kinds[-10:]
    finally:
        await poller.aclose()
    assert src.connects == 1 and src.stream_starts == 10, (src.connects, src.stream_starts)
    chans, timers, tasks, sessions = zip(*marks)
    assert max(chans) <= 2 and max(sessions) == 1, marks
    assert max(timers) <= 6, marks  # a restart's own timers come and go; none pile up
    assert max(tasks[3:]) <= max(tasks[:3]), marks
