"""A waiter asks only for what can exist, does not hold GPUs it would not be given before
they are free again (backfill), and `free` lists every free GPU, your own reservations
marked yours, whoever waits.

Against real sshd hosts (q1 with two idle GPUs, q2 with one) and real users."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from dataclasses import replace

import pytest

from gputop.reservations.store import StoreState
from gputop.reservations.terms import Target, Terms, new_reservation
from tests.support.as_user import wait_as
from tests.support.fleet import Fleet
from tests.support.queue_team import Team, team_on, text, two_host_fleet, until
from tests.test_free_table import rows
from tests.test_free_table import run as run_tty


@pytest.fixture(scope="module")
def bfleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    yield from two_host_fleet(tmp_path_factory, "bfleet", "127.0.132.2", "127.0.132.3")


@pytest.fixture
def team(bfleet: Fleet) -> Iterator[Team]:
    with team_on(bfleet) as t:
        yield t


def _hold(team: Team, gpu: str, user: str, hours: float) -> None:
    host, i = gpu.split(":")

    def change(state: StoreState, now: object) -> StoreState:
        from datetime import datetime

        assert isinstance(now, datetime)
        r = new_reservation(Target(host, int(i)), Terms(hours * 3600, user=user, machine="m"), now)
        return replace(state, reservations=(*state.reservations, r))

    team.store.update(change)


def _only_q1(team: Team, user: str) -> None:
    """``user``'s known_hosts keeps only q1's key: q2 does not answer her (host-key)."""
    q1 = team.fleet.hosts["q1"]
    kh = team.homes[user] / ".ssh" / "known_hosts"
    kh.write_text("".join(line + "\n" for line in kh.read_text().splitlines()
                          if line.split(" ", 1)[0] == f"[{q1.address}]:{q1.port}"))


def _as_root(team: Team, *argv: str, tty: bool) -> tuple[int, str, str]:
    return run_tty(["--config", str(team.config), *argv], team.env("gtalice"), tty=tty)


def test_a_waiter_for_more_than_the_known_gpus_is_refused_at_once(team: Team) -> None:
    """25 GPUs on a fleet whose known GPUs are 2 (q2 does not answer gtalice): refused
    before joining, with the numbers and the host not answering, not a wait for ever."""
    _only_q1(team, "gtalice")
    r = team.run("free", "--wait", "--count", "25", timeout=30)
    assert r.returncode == 2, r.stderr
    assert ("25 GPUs wanted, but the known GPUs can give 2 in all (q1 2; 1 host(s) not "
            "answering, their GPUs unknown: q2)") in r.stderr, r.stderr
    r = team.run("run", "--wait", "--count", "3", "--", "true", timeout=30)
    assert r.returncode == 2, r.stderr
    assert "3 GPUs wanted, but the known GPUs can give 2 the most on one host" in r.stderr
    assert team.state().queue == ()


def test_a_request_that_ends_before_the_waiters_turn_is_backfilled(team: Team) -> None:
    """gtalice waits for all three GPUs; q1:1 and q2:0 are held for 2h, so her turn comes
    in 2h at the earliest. q1:0, free now, is hers then: taking it for 3h would delay her
    (refused), for 1h does not (granted), by hand and by a later waiter alike."""
    _hold(team, "q1:1", "gtcarol", 2)
    _hold(team, "q2:0", "gtcarol", 2)
    a = team.start("free", "--wait", "--count", "3", "--lease", "5", user="gtalice", tag="a")
    until(lambda: team.queue_users() == ["gtalice"], what="A queued")
    r = team.run("reserve", "q1:0", "--for", "3h", user="gtbob")
    assert r.returncode == 1, r.stderr
    assert "gtalice" in r.stderr and "their turn comes" in r.stderr, r.stderr
    assert "(a shorter --for) is granted" in r.stderr
    r = team.run("free", "--count", "1", "--reserve", "--for", "3h", user="gtbob")
    assert r.returncode == 1, r.stderr
    assert "q1:0" not in team.held()
    r = team.run("free", "--count", "1", "--reserve", "--for", "1h", user="gtbob")
    assert (r.returncode, r.stdout) == (0, "q1:0\n"), r.stderr
    assert team.held()["q1:0"] == "gtbob" and team.queue_users() == ["gtalice"]
    team.free("q1:0")
    r = team.run("free", "--wait", "--count", "1", "--for", "1h", "--lease", "5",
                 user="gtbob")
    assert (r.returncode, r.stdout) == (0, "q1:0\n"), r.stderr
    team.free("q1:0")
    r = team.run("reserve", "q1:0", "--for", "1h", user="gtbob")
    assert r.returncode == 0, r.stderr
    assert team.queue_users() == ["gtalice"]
    # Granted for 1h, then extended past her turn: that is taking it anew, and refused
    # (a short --for was a way round the queue); within what he holds, it is kept.
    r = team.run("reserve", "q1:0", "--for", "3h", user="gtbob")
    assert r.returncode == 1 and "their turn comes" in r.stderr, r.stderr
    r = team.run("reserve", "q1:0", "--for", "30m", user="gtbob")
    assert r.returncode == 0 and "kept your reservation" in r.stdout, (r.stdout, r.stderr)
    assert team.state().events == () or all(e.get("kind") != "skip-queue"
                                             for e in team.state().events)
    os.kill(a[0], signal.SIGINT)
    assert wait_as(a[0], 20) == 130, text(a[2])


def test_free_lists_every_free_gpu(team: Team) -> None:
    """Three free: all three, on a terminal and in a pipe; --count 2 picks two."""
    code, out, err = _as_root(team, "free", tty=False)
    assert code == 0, err
    assert sorted(out.split()) == ["q1:0", "q1:1", "q2:0"]
    code, out, err = _as_root(team, "free", tty=True)
    assert code == 0, err
    assert sorted(r[0] for r in rows(out)[1:]) == ["q1:0", "q1:1", "q2:0"], out
    code, out, err = _as_root(team, "free", "--count", "2", tty=False)
    assert code == 0 and len(out.split()) == 2, (out, err)


def test_your_own_idle_reservation_stays_in_free_while_others_wait(team: Team) -> None:
    """root holds q1:0 (idle); gtalice waits for all three GPUs. root's `free` still lists
    q1:0, marked yours in the table and in --json."""
    _hold(team, "q1:0", "root", 2)
    a = team.start("free", "--wait", "--count", "3", "--lease", "5", user="gtalice", tag="a")
    until(lambda: team.queue_users() == ["gtalice"], what="A queued")
    code, out, err = _as_root(team, "free", tty=False)
    assert (code, out) == (0, "q1:0\n"), err
    code, out, err = _as_root(team, "free", tty=True)
    assert code == 0, err
    ((gpu, *_, mark),) = rows(out)[1:]
    assert gpu == "q1:0" and mark.startswith("yours"), out
    code, out, err = _as_root(team, "free", "--json", tty=False)
    assert code == 0, err
    assert [(f["host"], f["gpu"], f["yours"]) for f in json.loads(out)["free"]] == [
        ("q1", 0, True)]
    os.kill(a[0], signal.SIGINT)
    assert wait_as(a[0], 20) == 130, text(a[2])
