"""The queue tests' shared set-up: a two-host fleet (q1 with two GPUs, q2 with one) and a
Team on it (a shared reservations file, a config, a home per real test user), with the
waits the tests poll on. Shared by test_queue, test_fair_queue and test_hostile_shares,
each on its own loopback addresses."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gputop.reservations.state import StoreState
from gputop.reservations.store import Store
from gputop.reservations.terms import Target, Terms, new_reservation
from tests.support.as_user import need_test_users, run_as, shared_tmp, start_as, team_dir, user_home
from tests.support.fleet import Fleet, GpuProcess, Host
from tests.support.shared_fleet import need_sshd, world_readable

INTERVAL = 0.5
GRACE = 1.0


def two_host_fleet(tmp_path_factory: pytest.TempPathFactory, label: str,
                   q1: str, q2: str) -> Iterator[Fleet]:
    """A module fixture's body: q1 at ``q1`` with two idle RTX 2080s, q2 at ``q2`` with
    one (the names the Team's config uses), stopped when the module is done."""
    need_sshd()
    f = Fleet(world_readable(tmp_path_factory.mktemp(label)), [
        Host("q1", q1, gpus=("rtx2080", "rtx2080")),
        Host("q2", q2, gpus=("rtx2080",)),
    ]).start()
    yield f
    f.stop()


@contextlib.contextmanager
def team_on(fleet: Fleet) -> Iterator[Team]:
    """A fresh Team on ``fleet``; whatever its test left running is killed after."""
    need_test_users()
    with shared_tmp() as tmp:
        t = Team(fleet, tmp)
        try:
            yield t
        finally:
            t.stop()


class Team:
    """A shared reservations file, a config and a home per test user."""

    def __init__(self, fleet: Fleet, tmp: Path) -> None:
        self.fleet, self.tmp = fleet, tmp
        self.path = team_dir(tmp) / "reservations.json"
        self.config = tmp / "hosts.toml"
        self.config.write_text(
            # (wait_all: as tests/support/fleet.py's write_config, see there)
            f"[defaults]\ntimeout = 20.0\ninterval = {INTERVAL}\nwait_all = true\n\n"
            f'[reservations]\npath = "{self.path}"\njob_grace = "{GRACE:g}s"\n\n'
            '[[hosts]]\nname = "q1"\ntags = ["big"]\n\n'
            '[[hosts]]\nname = "q2"\ntags = ["small"]\n')
        self.config.chmod(0o644)
        self.homes = {u: user_home(fleet, tmp, u) for u in ("gtalice", "gtbob")}
        self.store = Store(self.path)
        self.started: list[int] = []

    def env(self, user: str) -> dict[str, str]:
        return self.fleet.env() | {"HOME": str(self.homes[user]), "TZ": "UTC"}

    def run(self, *args: str, user: str = "gtalice",
            timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return run_as(user, ["--config", str(self.config), *args], self.env(user), self.tmp,
                      timeout=timeout)

    def start(self, *args: str, user: str, tag: str) -> tuple[int, Path, Path]:
        started = start_as(user, ["--config", str(self.config), *args], self.env(user),
                           self.tmp, tag)
        self.started.append(started[0])
        return started

    def stop(self) -> None:
        """Whatever a failed test left running (a waiter still waiting) is killed."""
        for pid in self.started:
            with contextlib.suppress(ChildProcessError, ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)

    def state(self) -> StoreState:
        return self.store.read()

    def held(self) -> dict[str, str]:
        """``host:gpu`` -> user, from the file as it is."""
        return {f"{r.host}:{r.gpu}": r.user for r in self.state().active()}

    def block(self, *gpus: str, user: str = "gtbob") -> None:
        """Reserve GPUs for someone (as the file would hold them), bypassing the CLI."""
        def change(state: StoreState, now: Any) -> StoreState:
            rs = list(state.reservations)
            for g in gpus:
                host, i = g.split(":")
                rs.append(new_reservation(
                    Target(host, int(i)), Terms(3600, user=user, machine="m"), now))
            return replace(state, reservations=tuple(rs))
        self.store.update(change)

    def free(self, *gpus: str) -> None:
        self.store.update(lambda s, now: replace(s, reservations=tuple(
            r for r in s.reservations if f"{r.host}:{r.gpu}" not in gpus)))

    def queue_users(self) -> list[str]:
        return [w.user for w in self.state().waiting()]


def text(p: Path) -> str:
    try:
        return p.read_text()
    except FileNotFoundError:  # the child has not opened it yet
        return ""


def until(cond: Callable[[], Any], timeout: float = 20.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        time.sleep(0.05)


@contextlib.contextmanager
def file_locked(team: Team) -> Iterator[None]:
    """Another writer holding the reservations file's lock (this test process)."""
    import fcntl

    fd = os.open(team.store.lock_path, os.O_RDWR | os.O_CREAT, 0o664)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def on_gpu(team: Team, host: str, user: str | None, gpu: int = 0, mem_mib: int = 1024,
           command: str = "python train.py") -> Iterator[GpuProcess]:
    """A real process of ``user`` (None: the fleet's own, root) that the host's driver
    lists on GPU ``gpu``, using ``mem_mib``; gone again when the block ends."""
    h = team.fleet.hosts[host]
    p = GpuProcess(user, command, gpu=gpu, mem_mib=mem_mib)
    team.fleet.start_process(p)
    h.processes.append(p)
    team.fleet.set_scenario(h, h.scenario)
    try:
        yield p
    finally:
        h.processes.remove(p)
        assert p.popen is not None
        p.popen.kill()
        p.popen.wait()
        team.fleet.set_scenario(h, h.scenario)


def gpu_docs(team: Team, reader: str) -> dict[str, dict[str, Any]]:
    """Each GPU of ``gputop --json`` as ``reader`` sees it, by ``HOST:INDEX``."""
    r = team.run("--json", user=reader)
    assert r.returncode == 0, r.stderr
    return {f"{h['name']}:{g['index']}": g
            for h in json.loads(r.stdout)["hosts"] for g in h.get("gpus", [])}
