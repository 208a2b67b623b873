"""Attacks as a careless or hostile teammate on the shared file itself, with gputop's own
operations (the ones its commands run) on a real file: what one person does must not
erase the record of what they did to someone else."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path

from gputop.reservations.queue import remove_waiter
from gputop.reservations.store import MAX_EVENTS, Store, StoreState, Waiter


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
