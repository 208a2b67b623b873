"""Fair under a careless or hostile teammate, in the shared file itself (issue 19): the lock
survives its file being removed, the audit trail keeps forced actions, leases and expiries
are bounded when read. No hosts needed: these are rules of the file."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from gputop.model import iso, utcnow
from gputop.reservations.ops import release, reserve_outcomes
from gputop.reservations.order import QueueView
from gputop.reservations.records import MAX_EVENTS, Waiter
from gputop.reservations.state import StoreState
from gputop.reservations.store import Store
from gputop.reservations.terms import Target, Terms, new_reservation

H = 3600.0


_SECOND_WRITER = """
import sys
from dataclasses import replace
from pathlib import Path
from gputop.reservations.store import Store
from gputop.reservations.terms import Target, Terms
store = Store(Path(sys.argv[1]))
store.update(lambda s, now: replace(s, reservations=s.reservations + (
    new_reservation(Target("h", 1), Terms(3600, note="bob's", user="bob", machine="m"),
                    now),)), timeout=10)
"""


def test_a_writer_stalled_while_the_lock_file_is_removed_loses_nobodys_update(
        tmp_path: Path) -> None:
    """Finding 7: writer A stalls inside its update (^Z, an NFS stall); meanwhile someone
    removes the lock file and writer B (another process) takes a new lock and reserves h:1.
    When A goes on, its write must not drop B's reservation: A sees that the file it
    locked is no longer the lock, and applies its change again to the file as it is."""
    path = tmp_path / "r.json"
    store = Store(path)
    store.update(lambda s, now: s)  # the lock file exists
    inside, go = threading.Event(), threading.Event()
    calls = []

    def change(state: StoreState, now: object) -> StoreState:
        calls.append(len(state.reservations))
        if len(calls) == 1:
            inside.set()
            assert go.wait(30)
        return replace(state, reservations=(
            *state.reservations, new_reservation(
                Target("h", 0), Terms(H, user="ann", machine="m"), utcnow())))

    a = threading.Thread(target=store.update, args=(change,))
    a.start()
    assert inside.wait(30)
    # A careless `rm`, or a cleanup script: the lock files (the record lock's and the
    # flock writers over SSH share, which would still hold B back on its own).
    store.lock_path.unlink()
    store.flock_path.unlink()
    b = subprocess.run([sys.executable, "-c", _SECOND_WRITER, str(path)],
                       capture_output=True, text=True, timeout=60)
    assert b.returncode == 0, b.stderr  # B was not blocked: A's lock is on a removed file
    go.set()
    a.join(30)
    held = {(r.host, r.gpu): r.user for r in store.read().reservations}
    assert held == {("h", 0): "ann", ("h", 1): "bob"}, held
    assert calls == [0, 1]  # A's change ran again, on the file with B's reservation


def test_a_replaced_lock_file_is_not_a_lock(tmp_path: Path) -> None:
    """A lock taken on a file that is then replaced at the path excludes nobody: the
    check after locking sees another inode and locks again."""
    store = Store(tmp_path / "r.json")
    store.update(lambda s, now: s)
    with store._locked(1.0) as held:
        assert held()
        store.lock_path.unlink()
        store.lock_path.touch()
        assert not held()
    with store._locked(1.0) as held:
        assert held()


def _round(store: Store, user: str) -> None:
    targets = [Target("h", i) for i in range(40)]
    # Each new reservation recorded as a skip-queue (as if a waiter claimed every GPU).
    reserve_outcomes(
        store, targets, Terms(H, max_seconds=7 * 86400, user=user), check=lambda s,
        n: [t.label for t in targets], event="skip-queue")
    release(store, None, user=user)


def test_cheap_rounds_cannot_push_a_force_release_out_of_the_trail(tmp_path: Path) -> None:
    """Finding 6: bob's forced release of ann's GPU is recorded; then mallory repeats a
    cheap round (reserve 40 GPUs recorded as skip-queue, release them) until more than
    MAX_EVENTS events followed. The force-release stays: forced actions keep their own
    bound, apart from other kinds."""
    store = Store(tmp_path / "r.json")
    reserve_outcomes(store, [Target("g", 0)], Terms(H, max_seconds=7 * 86400, user="ann"))
    release(store, [Target("g", 0)], force=True, user="bob")
    for _ in range(6):
        _round(store, "mallory")
    events = store.read().events
    forced = [e for e in events if e["action"] == "force-release"]
    assert len(forced) == 1 and forced[0]["by"] == "bob"
    skips = [e for e in events if e["action"] == "skip-queue"]
    assert len(skips) == MAX_EVENTS  # each kind bounded: the file cannot grow for ever
    assert skips[-1] == events[-1]


def _waiter(i: int, user: str, lease_s: float) -> Waiter:
    now = utcnow()
    return Waiter(id=f"w{i}", user=user, machine="m", count=1, created=now,
                  lease=now + timedelta(seconds=lease_s))


def test_far_future_leases_are_lapsed_pruned_and_not_counted(tmp_path: Path) -> None:
    """Finding 3: waiter entries with a lease of years (written into the file by hand)
    were hidden from every listing but counted: four locked a person out of the queue,
    a thousand the whole team ("refusing to write 1001 waiters"). Such a lease is treated
    as lapsed: not counted and dropped by the next write."""
    from gputop.reservations.queue import Queue, Request

    path = tmp_path / "r.json"
    store = Store(path)
    forged = tuple(_waiter(i, "ann" if i < 4 else "mallory", 86400 * 365 * 10)
                   for i in range(1000))
    store.update(lambda s, now: s)
    # Written by hand (a store write would already drop them).
    path.write_text(StoreState(queue=forged).to_json())
    assert store.read().waiting() == []
    assert Queue(store, Request(1), user="ann", machine="m").join() == 1
    assert Queue(store, Request(1), user="bob", machine="m").join() == 2
    assert [w.user for w in store.read().queue] == ["ann", "bob"]


def test_the_listing_shows_far_future_waiters_as_lapsed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A place nobody can see cannot be removed: `reservations` lists a lapsed place (a
    far-future lease included) with its id, so `release --waiter ID` can take it out."""
    import argparse

    from gputop.cli.reserve import cmd_reservations
    from gputop.config.load import Config
    from gputop.config.tables import Reservations

    path = tmp_path / "r.json"
    path.write_text(StoreState(queue=(_waiter(1, "mallory", 86400 * 365),)).to_json())
    config = Config(path=None, hosts=(), reservations=Reservations(path=path))
    assert cmd_reservations(config, argparse.Namespace(json=False)) == 0
    out = capsys.readouterr().out
    assert "lapsed" in out and "mallory" in out and "[id w1]" in out, out


def test_a_reservation_beyond_max_duration_counts_until_created_plus_max(
        tmp_path: Path) -> None:
    """Finding 3: a reservation whose expiry is further ahead than `max_duration` (written
    by hand, or by a teammate whose config allows more) is honoured only until created +
    max_duration, and flagged `beyond-max` (JSON and board)."""
    from gputop.model import FleetSnapshot, GpuInfo, HostSnapshot
    from gputop.reservations.flags import annotate, free_gpus

    now = utcnow()
    path = tmp_path / "r.json"
    old = new_reservation(
        Target("h", 0), Terms(86400 * 365, user="ann", machine="m"), now - timedelta(days=8))
    fresh = new_reservation(Target("h", 1), Terms(86400 * 365, user="ann", machine="m"), now)
    path.write_text(StoreState(reservations=(old, fresh)).to_json())
    store = Store(path, max_s=7 * 86400.0)
    state = store.read()
    assert [r.gpu for r in state.active(now)] == [1]  # h:0 ended a day ago
    assert state.ends(fresh) == fresh.created + timedelta(days=7)
    host = HostSnapshot(name="h", gpus=tuple(
        GpuInfo(index=i, uuid=f"GPU-{i}", memory_used_mib=0, memory_total_mib=1024,
                utilization_percent=0) for i in range(2)))
    assert [f.gpu.index for f in free_gpus([host], state, now=now, user="bob")] == [0]
    doc = annotate(FleetSnapshot(time=now, hosts=(host,)), state)
    g0, g1 = doc["hosts"][0]["gpus"]
    assert g0["reservation"] is None and g0["flags"] == []
    assert g1["flags"] == ["beyond-max"]
    assert g1["reservation"]["expires"] == iso(fresh.created + timedelta(days=7))
    # A write prunes what ended and keeps what the file says of the rest.
    store.update(lambda s, n: s)
    assert [r.gpu for r in Store(path).read().reservations] == [1]
    assert os.path.getsize(path) > 0


def test_the_waste_report_credits_the_holders_login_to_the_holder(tmp_path: Path) -> None:
    """Finding 5 in history: maria's reservation records that she is mgarcia on host a;
    mgarcia's process on her GPU is her use of her own reservation (it was mgarcia's
    "unreserved" use and her reservation "idle"). A reservation beyond max_duration counts
    only until created + max_duration (a day here)."""
    from gputop.history.db import HistoryDB
    from gputop.history.recorder import Recorder
    from gputop.history.report import collect, summarise
    from gputop.model import GpuInfo, HostSnapshot, ProcessInfo

    t0 = utcnow().replace(microsecond=0) - timedelta(hours=2)
    held = replace(new_reservation(Target("a", 0), Terms(3600 * 24, user="maria", machine="m"), t0),
                   login="mgarcia")
    far = new_reservation(
        Target("a", 1), Terms(86400 * 365, user="ann", machine="m"),
        t0 - timedelta(days=1, minutes=5))
    db = tmp_path / "h.sqlite3"
    rec = Recorder(HistoryDB(db, writer=True), interval=10.0, timeout=5.0,
                   clock=lambda: 0.0)
    rec.set_reservations(StoreState(reservations=(held, far), max_s=86400.0))
    for i in range(60):
        t = t0 + timedelta(seconds=10 * (i + 1))
        rec.record(HostSnapshot(name="a", time=t, gpus=(
            GpuInfo(index=0, uuid="GPU-0", utilization_percent=90, memory_used_mib=1000,
                    memory_total_mib=81559,
                    processes=(ProcessInfo(pid=100, user="mgarcia"),)),
            GpuInfo(index=1, uuid="GPU-1", utilization_percent=0, memory_used_mib=0,
                    memory_total_mib=81559))))
    rec.flush()
    rec.db.close()
    with HistoryDB(db) as h:
        doc = summarise(collect(h, t0.timestamp(), (t0 + timedelta(seconds=605)).timestamp()))
    users = {u["user"]: u for u in doc["users"]}
    assert users["maria"]["used_hours"] == pytest.approx(600 / 3600)
    assert users["maria"]["reserved_idle_hours"] == 0
    assert "mgarcia" not in users or users["mgarcia"]["unreserved_hours"] == 0
    assert "ann" not in users or users["ann"]["reserved_hours"] == 0  # ended a day on


def test_a_forged_place_cannot_claim_gpus_the_reader_knows_it_cannot_use() -> None:
    """A waiter's `sees` is what its own gputop says; a hand-written place that claims
    hosts for a request they could never meet (50 GPUs across two 2-GPU hosts, 3 on one
    2-GPU host) holds back nothing the reader can see, while an honest one does. A host
    the reader did not look at is given the benefit of the doubt (finding 4: `reserve
    HOST:GPU` looks at the named host only)."""
    from gputop.model import GpuInfo, HostSnapshot
    from gputop.reservations.flags import FreeGpu

    now = utcnow()
    hosts = [HostSnapshot(name=h, gpus=tuple(
        GpuInfo(index=i, uuid=f"GPU-{h}-{i}", memory_used_mib=0, memory_total_mib=1024,
                utilization_percent=0) for i in range(2))) for h in ("a", "b")]

    def w(count: int, one_host: bool = False) -> Waiter:
        return Waiter(id="w", user="x", machine="m", count=count, created=now,
                      lease=now + timedelta(seconds=60), one_host=one_host, sees=("a", "b"))

    a0 = FreeGpu("a", hosts[0].gpus[0])
    assert QueueView(StoreState(), hosts, utcnow(), None).could_use([w(4)])(a0)
    assert QueueView(StoreState(), hosts, utcnow(), None).could_use([w(2, True)])(a0)
    assert not QueueView(StoreState(), hosts, utcnow(), None).could_use([w(50)])(a0)
    assert not QueueView(StoreState(), hosts, utcnow(), None).could_use([w(3, True)])(a0)
    assert QueueView(
        StoreState(), hosts[:1], utcnow(), None).could_use([w(50)])(a0)  # b not seen: it may be big


def test_a_smaller_max_duration_of_ones_own_cuts_nobody_elses_reservation(
        tmp_path: Path) -> None:
    """Fair under a careless teammate: bob's config says max_duration = 1d; ann reserved
    for 3 days under the team's 7d two days ago. Bob's gputop neither counts it as ended
    nor drops it when it writes: bounds below the default 7 days apply to one's own
    requests only."""
    now = utcnow()
    path = tmp_path / "r.json"
    ann = new_reservation(
        Target("h", 0), Terms(3 * 86400, user="ann", machine="m"), now - timedelta(days=2))
    path.write_text(StoreState(reservations=(ann,)).to_json())
    bob = Store(path, max_s=86400.0)
    assert [r.id for r in bob.read().active(now)] == [ann.id]
    bob.update(lambda s, n: replace(s, reservations=(
        *s.reservations, new_reservation(Target("h", 1), Terms(3600, user="bob", machine="m"), n))))
    assert {r.user for r in Store(path).read().active()} == {"ann", "bob"}
    assert not bob.read().active(now)[0].beyond_max
