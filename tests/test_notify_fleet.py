"""The sender on the real-sshd fleet: the hub's collection looked at by the notice watcher
(what ``gputop serve`` with [notify] and ``gputop notify run`` run), real users queueing
and holding GPUs. A grant and an idle flag each make exactly one notice, to the right
person only (a recording Notifier stands in for delivery). A waiting command rings its
terminal when granted (a real pseudo-terminal), never a pipe."""

from __future__ import annotations

import asyncio
import errno
import os
import pty
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gputop.config.load import load_config
from gputop.hub.notifying import serve_notices
from gputop.notify.notice import Notice
from gputop.notify.watcher import Watcher
from tests.support.fleet import Fleet
from tests.support.queue_team import Team, on_gpu, team_on, two_host_fleet, until


@pytest.fixture(scope="module")
def nfleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    yield from two_host_fleet(tmp_path_factory, "nfleet", "127.0.235.2", "127.0.235.3")


@pytest.fixture
def team(nfleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> Iterator[Team]:
    monkeypatch.setenv("HOME", str(nfleet.home))  # (the sender's own ssh, in-process)
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    with team_on(nfleet) as t:
        yield t


class Recorder:
    def __init__(self) -> None:
        self.got: list[Notice] = []
        self.lock = threading.Lock()

    def submit(self, notice: Notice) -> None:
        with self.lock:
            self.got.append(notice)

    def now(self) -> list[Notice]:
        with self.lock:
            return list(self.got)


class Sender:
    """``serve_notices`` on its own thread and event loop, stopped by ``stop``."""

    def __init__(self, config: Path, memory: Path) -> None:
        self.rec = Recorder()
        cfg = load_config(str(config))
        self.watcher = Watcher(self.rec, memory, host_grace_s=3600)
        self.loop = asyncio.new_event_loop()
        self.task: asyncio.Task[None] | None = None
        self.thread = threading.Thread(target=self._run, args=(cfg,), daemon=True)
        self.thread.start()

    def _run(self, cfg: object) -> None:
        async def main() -> None:
            self.task = asyncio.current_task()  # type: ignore[assignment]
            await serve_notices(cfg, self.watcher)  # type: ignore[arg-type]

        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(main())
        except asyncio.CancelledError:
            pass

    def stop(self) -> None:
        until(lambda: self.task is not None, what="the sender started")
        assert self.task is not None
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(30)


def test_a_grant_and_an_idle_flag_each_make_one_notice_for_the_right_person(
        team: Team, tmp_path: Path) -> None:
    cfg = tmp_path / "hosts.toml"
    cfg.write_text(team.config.read_text().replace(
        "[reservations]\n", '[reservations]\nidle_grace = "2s"\n'))
    team.block("q1:0", "q1:1", "q2:0")  # gtbob's: busy on q1, nothing running on q2:0
    sender: Sender | None = None
    with on_gpu(team, "q1", "gtbob", gpu=0), on_gpu(team, "q1", "gtbob", gpu=1):
        try:
            sender = Sender(cfg, tmp_path / "sent.json")
            team.start("free", "--wait", "--count", "1", "--lease", "5", "--for", "1h",
                       user="gtalice", tag="a")
            until(lambda: team.queue_users() == ["gtalice"], 60, "gtalice queued")
            rec = sender.rec
            until(lambda: any(n.kind == "idle" for n in rec.now()), 60, "an idle notice")
            time.sleep(2.5)  # several more looks: the flag still stands, said once
            team.free("q2:0")
            until(lambda: any(n.kind == "granted" for n in rec.now()), 60, "the grant")
            time.sleep(1.5)
        finally:
            if sender is not None:
                sender.stop()
    got = sender.rec.now()
    idle = [n for n in got if n.kind == "idle" and n.fields.get("target") == "q2:0"
            and n.user == "gtbob"]
    granted = [n for n in got if n.kind == "granted"]
    assert len(idle) == 1, got
    assert [n.user for n in granted] == ["gtalice"], got
    assert "CUDA_VISIBLE_DEVICES=0 on q2" in granted[0].lines
    # gtbob is told about his idle GPU alone; nothing about q1, where he works
    assert [n.kind for n in got if n.user == "gtbob"] == ["idle"], got
    assert all(n.user in ("gtalice", "gtbob") for n in got), got
    assert len({n.key for n in got}) == len(got)


def on_tty(argv: list[str], env: dict[str, str]) -> tuple[int, bytes]:
    """``gputop ARGV`` with stdout and stderr on one pseudo-terminal: all it wrote."""
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "gputop", *argv], env=env, stdout=slave,
                         stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until it exits (a helper it started may keep
        ready, _, _ = select.select([master], [], [], 0.2)  # the terminal open)
        chunk = b""
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError as exc:
                if exc.errno != errno.EIO:
                    raise
        out += chunk
        if not chunk and p.poll() is not None:
            break
    os.close(master)
    return p.wait(timeout=120), out


def test_a_grant_rings_a_terminal_and_not_a_pipe(team: Team) -> None:
    """`free --wait` and `run --wait`, granted at once (root's own, GPUs free)."""
    env = team.fleet.env() | {"TZ": "UTC", "GPUTOP_CONFIG": str(team.config)}
    rc, out = on_tty(["free", "--wait", "--count", "1", "--for", "5m"], env)
    assert rc == 0, out
    assert b"\a" in out
    assert b"\x1b]9;gputop: GPUs granted: q" in out
    assert b"\x1b]777;notify;gputop: GPUs granted;q" in out
    rc, out = on_tty(["run", "--wait", "--count", "1", "--for", "5m", "--", "true"], env)
    assert rc == 0, out
    assert b"\x1b]777;notify;gputop: GPUs granted;q" in out
    r = subprocess.run([sys.executable, "-m", "gputop", "free", "--wait", "--count", "1",
                        "--for", "5m"], env=env, capture_output=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert b"\a" not in r.stderr + r.stdout and b"\x1b]" not in r.stderr + r.stdout


def test_the_hub_sends_once_and_a_restarted_hub_sends_no_duplicates(
        team: Team, tmp_path: Path) -> None:
    """A real ``gputop serve`` with a [notify] table: an expiry warning reaches the
    holder's own webhook (a real aiohttp receiver) once, /metrics counts it; restarted,
    the hub sends it not again, and a new occurrence once."""
    from dataclasses import replace as dc_replace

    from gputop.notify.routes import set_route
    from gputop.reservations.state import StoreState
    from gputop.reservations.terms import Target, Terms, new_reservation
    from tests.support.hubs import Hub, get
    from tests.support.notify_servers import receiver

    cfg = tmp_path / "hosts.toml"
    cfg.write_text(team.config.read_text() + '\n[notify]\nexpiry_warning = "15m"\n')
    env = team.fleet.env() | {"TZ": "UTC", "XDG_STATE_HOME": str(tmp_path / "state")}

    def ending(host: str, minutes: float) -> None:
        def change(s: StoreState, now: object) -> StoreState:
            r = new_reservation(Target(host, 0), Terms(minutes * 60, user="root", machine="m"), now)
            return dc_replace(s, reservations=(*s.reservations, r))
        team.store.update(change)  # type: ignore[arg-type]

    with receiver() as rec:
        set_route(team.store, "webhook", rec.url + "/ok/root")
        ending("q1", 10)
        hub = Hub(cfg, env).start()
        try:
            first = rec.wait_for("/ok/root", 1, 30)
            assert len(first) == 1 and b"q1:0" in first[0].body
            until(lambda: b'gputop_notifications_total{channel="webhook",result="sent"} 1'
                  in get(hub.url + "metrics")[2], 20, "the counter")
            hub.stop()
            hub = Hub(cfg, env).start()
            ending("q2", 10)  # a new occurrence: told once, and only it
            got = rec.wait_for("/ok/root", 2, 30)
            time.sleep(3)  # several more looks
            got = [g for g in rec.got if g.path == "/ok/root"]
            assert len(got) == 2, [g.body[:80] for g in got]
            assert b"q2:0" in got[1].body and b"q1:0" not in got[1].body
        finally:
            hub.stop()
