"""Attacks as a careless or hostile teammate on the shared file itself, with gputop's own
operations (the ones its commands run) on a real file: what one person does must not
erase the record of what they did to someone else."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path

from gputop.reservations.queue import remove_waiter
from gputop.reservations.records import MAX_EVENTS, Waiter
from gputop.reservations.state import StoreState
from gputop.reservations.store import Store
from gputop.reservations.terms import Target, Terms


def _place(store: Store, user: str, wid: str) -> None:
    def change(state: StoreState, now: datetime) -> StoreState:
        w = Waiter(id=wid, user=user, machine="m", count=1, created=now,
                   lease=now + timedelta(seconds=30), sees=())
        return replace(state, queue=(*state.queue, w))
    store.update(change)


def test_removing_ones_own_places_cannot_push_out_a_forced_removal(tmp_path: Path) -> None:
    """bob removes alice's place with --force (recorded: queue-remove by bob of alice's
    waiter), then joins and leaves the queue by `release --waiter` (his own place: no
    force) 250 times, a few seconds' work. Own removals and forced ones shared one bound
    of 200, so the record of the forced one was gone; now only forced removals count
    toward it."""
    store = Store(tmp_path / "reservations.json")
    _place(store, "alice", "a1")
    remove_waiter(store, "a1", force=True, user="bob")
    for i in range(MAX_EVENTS + 50):
        _place(store, "bob", f"b{i}")
        remove_waiter(store, f"b{i}", user="bob")
    forced = [e for e in store.read().events
              if e["action"] == "queue-remove" and e["waiter"]["user"] != e["by"]]
    assert [(e["by"], e["waiter"]["id"]) for e in forced] == [("bob", "a1")]


def test_long_notes_copied_into_the_audit_trail_cannot_fill_the_file(tmp_path: Path) -> None:
    """alice's reservations carry 500-emoji notes (6 KB each in the file); every event
    copies the reservation, note and all: 200 job-ended (reserve --until-exit rounds),
    200 skip-queue and 200 force-release events of hers took 3.8 MB of the file's 4 MiB,
    after which a few reservations of her own made every teammate's write fail
    ("refusing to write ... bytes"). An event keeps the start of a note only."""
    from gputop.reservations.records import MAX_FILE_BYTES
    from gputop.reservations.store import new_reservation

    store = Store(tmp_path / "reservations.json")
    note = "\U0001f600" * 500

    def flood(state: StoreState, now: datetime) -> StoreState:
        evs = []
        for action in ("job-ended", "skip-queue", "force-release"):
            for i in range(MAX_EVENTS):
                r = new_reservation(
                    Target(f"host-{i:03d}", 0),
                    Terms(3600, note=note, user="alice", machine="laptop"), now)
                evs.append({"time": "2026-01-01T00:00:00Z", "action": action,
                            "by": "alice" if action != "force-release" else "bob",
                            "machine": "laptop", "reservation": r.to_dict()})
        return replace(state, events=tuple(evs))
    store.update(flood)
    size = (tmp_path / "reservations.json").stat().st_size
    assert size < MAX_FILE_BYTES // 8, size
    evs = store.read().events
    assert len(evs) == 3 * MAX_EVENTS
    assert evs[0]["reservation"]["note"].startswith("\U0001f600")
    assert {e["by"] for e in evs} == {"alice", "bob"}
