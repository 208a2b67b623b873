"""The streaming client path under attack: channel callbacks, one alarm per session, no
keepalive on streams, paced ``--watch``. (From the round-4 hostile review: each test names
what it reproduces; the unpaced controls were checked once and left out, to keep the
suite fast.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gputop.config.load import load_config
from gputop.config.tables import Defaults, Reservations
from gputop.poller import Poller
from gputop.sources.ssh import SshSource
from gputop.sources.stream_session import HostSession
from tests.support.fleet import Fleet, Host
from tests.support.shared_fleet import need_sshd, world_readable

INTERVAL = 0.5
TIMEOUT = 2.0


@pytest.fixture
def rfleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fleet]:
    need_sshd()
    f = Fleet(world_readable(tmp_path), [
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


async def _freeze_until_back(poller: Poller, host: Host, limit: float,
                             before: Callable[[], bool] = lambda: True,
                             ) -> tuple[list[str], float | None]:
    """Poll; after two good answers SIGSTOP the host's sshd (its connection goes silent,
    no FIN/RST); return the answers' kinds and how long until the host answered again
    after a timeout (None: not within ``limit`` seconds)."""
    frozen: list[int] = []
    kinds: list[str] = []
    frozen_at = 0.0
    back_after: float | None = None
    try:
        started = time.monotonic()
        async for snap in poller.updates():
            kinds.append(snap.error.kind if snap.error else "ok")
            if not frozen and kinds.count("ok") >= 2:
                assert before()
                assert host.proc is not None
                frozen = _sshd_tree(host.proc.pid)  # this connection's sshd: silent
                assert frozen
                for p in frozen:
                    os.kill(p, signal.SIGSTOP)
                frozen_at = time.monotonic()
            elif frozen and "timeout" in kinds and kinds[-1] == "ok":
                back_after = time.monotonic() - frozen_at
                break
            if time.monotonic() - started > limit:
                break
    finally:
        await poller.aclose()
        for p in frozen:
            os.kill(p, signal.SIGCONT)
    return kinds, back_after


async def test_a_frozen_connection_is_dropped_and_the_host_comes_back(rfleet: Fleet) -> None:
    """Finding: no keepalive on streaming connections (ssh/transport.py connect) and a
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
    kinds, back_after = await _freeze_until_back(poller, alpha, limit=40)
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


def _watch(fleet: Fleet, cfg: Path, pace: float | None) -> subprocess.Popen[str]:
    """``gputop --json --watch``; ``pace``: override headless.WATCH_PACE_S (None: as shipped)."""
    import sys
    code = ("import sys, gputop.cli as c, gputop.cli.headless as h\n"
            + (f"h.WATCH_PACE_S = {pace!r}\n" if pace is not None else "")
            + "sys.exit(c.main(sys.argv[1:]))")
    return subprocess.Popen(
        [sys.executable, "-c", code, "--json", "--watch", "--config", str(cfg)],
        env=fleet.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[1])


@pytest.mark.parametrize("pace", [None], ids=["paced"])
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
                conn = src.link.conn
                assert conn is not None
                marks.append((len(conn._channels), len(loop._scheduled),  # type: ignore[attr-defined]
                              len(asyncio.all_tasks()), len(_sessions(rfleet, alpha))))
                if len(marks) == 6:
                    break
                gpu = [ln for ln in rfleet.remote_processes(alpha) if "--query-gpu" in ln]
                assert len(gpu) == 1, gpu
                os.kill(int(gpu[0].split()[0]), signal.SIGKILL)
                oks_since_kill = 0
            assert len(kinds) < 400, kinds[-10:]
    finally:
        await poller.aclose()
    assert src.connects == 1 and src.stream_starts == 6, (src.connects, src.stream_starts)
    chans, timers, tasks, sessions = zip(*marks)
    assert max(chans) <= 2 and max(sessions) == 1, marks
    assert max(timers) <= 6, marks  # a restart's own timers come and go; none pile up
    assert max(tasks[2:]) <= max(tasks[:2]), marks


class _Gated:
    """A source whose query waits for the test; ``paced`` as a stream's would be."""

    kind = "ssh"
    connects = 0
    warnings: tuple[str, ...] = ()
    first_sample_s = None

    def __init__(self, name: str, paced: bool) -> None:
        self.name = name
        self.paced_after = paced
        self.paced = False
        self.calls = 0
        self.resets = 0
        self.gate: asyncio.Future[None] | None = None

    async def query(self) -> tuple[list[object], None]:
        self.paced = False
        self.calls += 1
        self.gate = asyncio.get_running_loop().create_future()
        await self.gate
        self.paced = self.paced_after
        return [], None

    def reset(self) -> None:
        self.resets += 1

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("paced", [False, True])
async def test_reconnect_during_a_query_or_a_nap_queries_again_at_once(paced: bool) -> None:
    """reconnect() while a query is in flight: the next query follows it without the
    interval's sleep; during the sleep: it ends the sleep. Each nap leaves no timer or
    future behind."""
    from gputop.config.load import Config
    from gputop.config.tables import HostConfig
    cfg = Config(path=None, hosts=(HostConfig("h"),), defaults=Defaults(interval=5.0, timeout=5.0),
                 reservations=Reservations(path=Path("/nonexistent/r.json")))
    src = _Gated("h", paced)
    poller = Poller(cfg, [src])  # type: ignore[list-item]
    got: list[float] = []

    async def consume() -> None:
        async for _snap in poller.updates():
            got.append(time.monotonic())

    feed = asyncio.ensure_future(consume())
    try:
        for _ in range(50):
            if src.gate is not None:
                break
            await asyncio.sleep(0.01)
        assert src.calls == 1 and src.gate is not None
        assert poller.reconnect("h") and src.resets == 1  # during the query
        src.gate.set_result(None)
        for _ in range(50):
            if src.calls == 2:
                break
            await asyncio.sleep(0.01)
        assert src.calls == 2  # at once, not after 5 s
        assert src.gate is not None
        src.gate.set_result(None)  # answered quickly: paced or not, the poller naps now
        await asyncio.sleep(0.1)
        assert src.calls == 2 and "h" in poller._naps
        assert poller.reconnect("h")  # during the nap: it ends
        for _ in range(50):
            if src.calls == 3:
                break
            await asyncio.sleep(0.01)
        assert src.calls == 3 and "h" not in poller._naps
    finally:
        feed.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feed
        await poller.aclose()
    assert poller._naps == {} and poller._woken <= {"h"}


class _Swallows:
    """A query that drops its first cancel and answers, as ``wait_for`` does before Python
    3.12 when the query it waits for finishes in the same loop turn as the cancel."""

    kind = "ssh"
    connects = 0
    warnings: tuple[str, ...] = ()
    first_sample_s = None
    paced = False

    def __init__(self, name: str) -> None:
        self.name = name
        self.swallowed = 0

    def reset(self) -> None:
        pass

    async def query(self) -> tuple[list[object], None]:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if self.swallowed:
                raise
            self.swallowed += 1
        return [], None

    async def close(self) -> None:
        pass


async def test_stopping_the_poller_outlasts_a_cancel_that_was_dropped() -> None:
    """A host's loop that went on after its cancel (it napped, then would have polled on
    for ever) still ends: SIGINT at 200 hosts in query mode hung the process on it."""
    from gputop.config.load import Config
    from gputop.config.tables import HostConfig
    cfg = Config(path=None, hosts=(HostConfig("h"), HostConfig("g")),
                 defaults=Defaults(interval=0.2, timeout=5.0),
                 reservations=Reservations(path=Path("/nonexistent/r.json")))
    sources = [_Swallows("h"), _Swallows("g")]
    poller = Poller(cfg, sources)  # type: ignore[list-item]

    async def consume() -> None:
        async for _snap in poller.updates():
            pass

    feed = asyncio.ensure_future(consume())
    await asyncio.sleep(0.1)  # both queries are waiting
    feed.cancel()
    await asyncio.wait({feed}, timeout=10)  # (not wait_for: it would wait on the hang)
    assert feed.done() and [s.swallowed for s in sources] == [1, 1]
    await asyncio.wait_for(poller.aclose(), 10)


def test_fast_paths_read_exactly_as_the_old_ones() -> None:
    """GpuInfo.from_row, to_dict, LineReader's one decode, parse_timestamp's day memo,
    iso's second memo and output.dumps' reused encoders, against what they replaced."""
    import dataclasses
    import json
    import pickle
    import random
    from datetime import datetime, timedelta, timezone

    from gputop import output
    from gputop.model import GpuInfo, ProcessInfo, iso
    from gputop.sources import stream_parse
    from gputop.sources.protocol import LineReader
    from gputop.sources.stream_parse import parse_timestamp
    from gputop.ssh.transport import ParseError

    rnd = random.Random(4)
    names = [f.name for f in dataclasses.fields(GpuInfo)]
    for k in range(len(names) + 1):
        vals = [rnd.choice([(), (ProcessInfo(1),)]) if n in ("processes", "instances")
                else rnd.choice([1, "x", None, 2.5]) for n in names[:k]]
        a, b = GpuInfo.from_row(vals), GpuInfo(*vals)
        assert a == b and hash(a) == hash(b) and repr(a) == repr(b)
        assert list(a.to_dict().items()) == list(b.to_dict().items())
        assert pickle.loads(pickle.dumps(a)) == b
        assert dataclasses.replace(a, index=7) == dataclasses.replace(b, index=7)

    def per_line(chunks: list[bytes]) -> list[str]:
        part, out = b"", []
        for d in chunks:
            *lines, part = (part + d).split(b"\n")
            out += [ln.decode("utf-8", "replace") for ln in lines]
        return out

    alphabet = [b"\n", b"a", b"\xe2", b"\x82", b"\xac", b"\xf0", b"\x9f", b"\xff", b"\r",
                b"\xed\xa0\x80", b"\xc3"]
    for _ in range(5000):
        s = b"".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 16)))
        cuts = sorted(rnd.sample(range(len(s) + 1), min(3, len(s) + 1)))
        chunks = [s[i:j] for i, j in zip([0, *cuts], [*cuts, len(s)])]
        reader = LineReader(1 << 20)
        assert [ln for c in chunks for ln in reader.feed(c)] == per_line(chunks), chunks

    t = datetime(2023, 12, 30, tzinfo=timezone.utc)  # a leap year, month and year ends
    while t < datetime(2025, 3, 2, tzinfo=timezone.utc):
        for extra in (0, 1, 43200.25, 86399.5):
            u = t + timedelta(seconds=extra)
            text = u.strftime("%Y/%m/%d %H:%M:%S") + (f".{u.microsecond // 1000:03d}"
                                                      if u.microsecond else "")
            assert parse_timestamp(text) == u.timestamp(), text
        t += timedelta(days=1)
    assert len(stream_parse._DAYS) <= 64
    for bad in ("2023/02/29 00:00:00", "2024/02/30 00:00:00", "2024/13/01 00:00:00",
                "2024/01/01 24:00:00", "2024/01/01 23:60:00", "2024/01/01 23:00:60"):
        with pytest.raises(ParseError):
            parse_timestamp(bad)

    for _ in range(3000):
        x = rnd.uniform(-1e9, 4e9)
        for tz in (timezone.utc, timezone(timedelta(hours=5, minutes=30)), None):
            d = datetime.fromtimestamp(x, tz)
            assert iso(d) == d.astimezone(timezone.utc).isoformat(
                timespec="seconds").replace("+00:00", "Z")

    doc = {"a": [1, 2.5, float("nan"), None, "\u00e9\u2028\ud800", {"x": (1, 2)}], "b": True}
    assert output.dumps(doc) == json.dumps(doc, ensure_ascii=True, separators=(",", ":"))
    assert output.dumps(doc, pretty=True) == json.dumps(doc, ensure_ascii=True, indent=2)


async def test_a_frozen_connection_of_a_host_that_fell_back_to_queries_is_dropped(
    rfleet: Fleet,
) -> None:
    """Finding (same root as the frozen stream): a host that connected to stream and then
    fell back to a query per refresh (here: no awk) keeps its connection without a
    keepalive; a query that times out keeps the connection, so once its peer goes silent
    the host stays a timeout for ever (before: the keepalive closed it)."""
    alpha = rfleet.hosts["alpha"]
    (rfleet.root / "alpha" / "bin" / "awk").write_text(
        "#!/bin/sh\necho 'sh: 1: awk: not found' >&2\nexit 127\n")
    (rfleet.root / "alpha" / "bin" / "awk").chmod(0o755)
    cfg = rfleet.write_config(["alpha"], timeout=TIMEOUT, interval=INTERVAL,
                              first_sample_timeout=3.0)
    poller = Poller(load_config(str(cfg)))
    src = poller.sources[0]
    assert isinstance(src, SshSource)
    kinds, back_after = await _freeze_until_back(
        poller, alpha, limit=30, before=lambda: not src.streaming)  # it fell back
    assert back_after is not None, (kinds[-8:], src.connects)
    assert back_after < 20, back_after


@pytest.mark.parametrize("pace", [None], ids=["paced"])
def test_a_signal_ends_watch_at_once_while_a_connection_is_frozen(
    rfleet: Fleet, pace: float | None,
) -> None:
    """SIGTERM while a host's connection is frozen (its sshd silent): gputop still ends
    within a few seconds, with 143 and no traceback."""
    import json
    alpha = rfleet.hosts["alpha"]
    cfg = rfleet.write_config(["alpha"], timeout=3.0, interval=1.0)
    proc = _watch(rfleet, cfg, pace)
    assert proc.stdout is not None
    frozen: list[int] = []
    try:
        for _ in range(2):
            assert json.loads(proc.stdout.readline())["hosts"][0]["status"] == "ok"
        assert alpha.proc is not None
        frozen = _sshd_tree(alpha.proc.pid)
        for p in frozen:
            os.kill(p, signal.SIGSTOP)
        time.sleep(1.5)  # a refresh is waiting on the frozen connection
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in frozen:
            os.kill(p, signal.SIGCONT)
    stderr = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == 143 and "Traceback" not in stderr, stderr
    assert took < 5.0, took


class _FakeChan:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = self.paused = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.paused = True

    def get_exit_status(self) -> int | None:
        return 7


class _FakeConn:
    async def create_session(self, factory: object, command: str,
                             encoding: object = None) -> tuple[_FakeChan, object]:
        self.sess = factory()  # type: ignore[operator]
        self.chan = _FakeChan()
        return self.chan, self.sess


async def _opening(packets: object) -> tuple[HostSession, _FakeConn, asyncio.Future[None]]:
    conn = _FakeConn()
    st = HostSession(conn, 0.5, 1 << 20)  # type: ignore[arg-type]
    task = asyncio.ensure_future(st.start())
    for _ in range(3):
        await asyncio.sleep(0)
    nonce = conn.chan.written[0].decode().strip()
    for p in packets(nonce):  # type: ignore[operator]
        conn.sess.data_received(p, None)  # type: ignore[attr-defined]
    await asyncio.sleep(0)
    return st, conn, task


async def test_the_channel_callbacks_take_any_banner_flood_or_close_without_raising() -> None:
    """asyncssh's callbacks (data, EOF, close) with a banner split over packets and not
    UTF-8, a start line split in two with a sample behind it, a flood with no line end,
    a close before the start line, data after close: every outcome is the session's own,
    nothing raises out of a callback."""
    from gputop.sources.protocol import MARK
    from gputop.ssh.transport import ParseError
    from tests.test_stream_parse import row

    def g(i: int) -> bytes:
        return f"g {row(i, 2)}\n".encode()

    def banner_then_start(n: str) -> list[bytes]:
        start = f"{MARK} {n} start 4242\n".encode()
        return [b"Welcome \xff\xfe", b"\xe2\x82 motd\nmore\n" + start[:7],
                start[7:] + g(0) + g(1)]

    st, conn, task = await _opening(banner_then_start)
    await asyncio.wait_for(task, 1)
    assert st.pid == 4242 and st.seq == 1 and st.error is None
    for _ in range(20):  # a line that never ends: cut at the limit, reading paused
        conn.sess.data_received(b"g " + b"x" * 65536, None)  # type: ignore[attr-defined]
    assert st.error is not None and st.error.kind == "parse" and conn.chan.paused
    conn.sess.eof_received()  # type: ignore[attr-defined]
    conn.sess.connection_lost(None)  # type: ignore[attr-defined]
    conn.sess.connection_lost(OSError("late"))  # type: ignore[attr-defined]
    assert st.error.kind == "parse" and st.ended is None
    st.close()

    st, conn, task = await _opening(lambda n: [b"only a banner\n"])
    conn.sess.eof_received()  # type: ignore[attr-defined]
    conn.sess.connection_lost(None)  # type: ignore[attr-defined]
    with pytest.raises(ParseError, match="did not run"):
        await asyncio.wait_for(task, 1)
    assert conn.chan.closed
    st.close()

    st, conn, task = await _opening(lambda n: [b"x" * 70000])  # a banner with no end
    with pytest.raises(ParseError):
        await asyncio.wait_for(task, 1)
    st.close()

    st, conn, task = await _opening(lambda n: [f"{MARK} {n} start 1\n".encode()])
    await asyncio.wait_for(task, 1)
    conn.sess.data_received(g(0) + g(1), None)  # type: ignore[attr-defined]
    assert st.seq == 1
    conn.sess.connection_lost(None)  # type: ignore[attr-defined]
    assert st.ended == 7
    st.close()
    conn.sess.data_received(b"garbage\n", None)  # type: ignore[attr-defined]
    conn.sess.eof_received()  # type: ignore[attr-defined]
    assert st.error is None and st.ended == 7
