"""The hub's one collection: every host polled once, whatever the number of readers.

Each host's loop (``Poller.updates``) hands over its answers; they are folded into the
``--json`` document at most every ``coalesce_s`` (so a change reaches readers within
that of its answer, not one interval later), and only the hosts that answered anew are
annotated again (all of them when the reservations file changed). Every fold that changed
anything becomes one update for the event stream: the hosts that changed, complete, and
any other top-level key that changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from gputop.config.load import Config
from gputop.hub.patches import host_change
from gputop.model import SCHEMA_VERSION, HostError, HostSnapshot, iso, utcnow
from gputop.output import dumps
from gputop.poller import Poller
from gputop.reservations.filelock import StoreError
from gputop.reservations.flags import (
    IdleTracker,
    annotated_host,
    queue_document,
    reservations_document,
)
from gputop.reservations.open import open_store
from gputop.reservations.state import StoreState
from gputop.reservations.summary import Tally, host_tally, indexes

#: Top-level keys an update's ``set`` may carry (anything but version, time and hosts).
OTHER_KEYS = ("queue", "reservations", "reservations_error", "summary")


@dataclass
class HostStats:
    """What the hub counts per host, for ``/metrics``."""

    answers: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    last_answer: float | None = None  # time.time() of the last answer, any kind
    answered: bool = False  # a first real answer (not "starting") or its timeout, folded


class Collector:
    """Holds the current document; calls ``on_update(update_json, patch_json)`` per
    change (the same change as an ``update`` and, while ``patches_wanted()``, as a
    ``patch``: see hub/patches.py; None when every changed host goes complete: the
    update is that patch)."""

    def __init__(self, config: Config, poller: Poller | None = None,
                 coalesce_s: float | None = None) -> None:
        self.config = config
        self.poller = poller if poller is not None else Poller(config)
        self.names = [s.name for s in self.poller.sources]
        self.coalesce_s = (coalesce_s if coalesce_s is not None
                           else min(0.1, config.defaults.interval / 4))
        self.store = open_store(config)
        #: How often the shared file's signature is looked at (a stat, or one round trip).
        self.store_every_s = min(2.0, max(0.25, config.defaults.interval / 2))
        self.tracker = IdleTracker(config.defaults.idle_holder_s, config.reservations.idle_grace_s)
        self.stats = {n: HostStats() for n in self.names}
        self.refreshes = 0  # folds that changed something
        self.folds = 0
        self.fold_seconds = 0.0  # CPU time spent folding (process time)
        self.started = time.time()
        self._latest: dict[str, HostSnapshot] = {}
        self._dirty: set[str] = set()
        self._hosts: dict[str, dict[str, Any]] = {}
        #: Each host's part of the summary, counted again only when the host is refolded.
        self._tallies: dict[str, Tally] = {}
        self._state: StoreState | None = None
        self._state_key: object = None
        self._read_sig: object = None
        self._read_result: tuple[StoreState | None, str | None] = (
            None, "the reservations file has not been read yet")
        if not self.store.remote:  # (over SSH: the first read is the watcher's, not here)
            self.refresh_store()
        self._other: dict[str, Any] = {}
        self._listed: tuple[StoreState, list[dict[str, Any]]] | None = None
        self.time = utcnow()
        self._kick = asyncio.Event()
        self.on_update: Callable[[str, str | None], None] = lambda update, patch: None
        #: Whether anyone reads patches now: when nobody does, none is worked out (a
        #: reader resuming later gets the update instead, which it also takes).
        self.patches_wanted: Callable[[], bool] = lambda: True
        now = utcnow()
        for n in self.names:  # until a host answers: a placeholder, so the document is whole
            self._latest[n] = HostSnapshot(name=n, time=now, source="none",
                                           error=HostError("starting", "no answer yet"))
        self._refold_all()

    # -- state ------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Every host answered once (or timed out)."""
        return all(s.answered for s in self.stats.values())

    def document(self) -> dict[str, Any]:
        """The ``--json`` document as it stands."""
        doc: dict[str, Any] = {"version": SCHEMA_VERSION, "time": iso(self.time),
                               "hosts": [self._hosts[n] for n in self.names]}
        doc.update((k, v) for k, v in self._other.items() if v is not None)
        return doc

    def latest(self, name: str) -> HostSnapshot | None:
        return self._latest.get(name)

    # -- running ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Poll until cancelled; the poller's connections are closed on the way out."""
        feed = asyncio.create_task(self._consume())
        store = asyncio.create_task(self._watch_store())
        try:
            while True:
                await self._kick.wait()
                await asyncio.sleep(self.coalesce_s)  # answers that come together fold once
                self._kick.clear()
                for task in (feed, store):
                    if task.done():
                        task.result()  # the feed (or the store's watcher) failed: say why
                self.fold()
        finally:
            for task in (feed, store):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.poller.aclose()
            self.store.close()

    async def _consume(self) -> None:
        async for snap in self.poller.updates():
            self.observe(snap)

    def observe(self, snap: HostSnapshot) -> None:
        st = self.stats.get(snap.name)
        if st is None:
            return
        st.answers += 1
        st.last_answer = time.time()
        if snap.error is not None:
            st.errors[snap.error.kind] = st.errors.get(snap.error.kind, 0) + 1
        self.tracker.observe(snap)
        self._latest[snap.name] = snap
        self._dirty.add(snap.name)
        self._kick.set()

    def fold(self) -> None:
        """Fold what arrived into the document; publish what changed."""
        t0 = time.process_time()
        now = utcnow()
        self.folds += 1
        state, problem = self._read_reservations()
        other = self._other_keys(state, problem, now)
        dirty, self._dirty = self._dirty, set()
        if self._state_changed(state):
            dirty = set(self.names)
        changed = []
        patches = self.patches_wanted()
        whole: list[dict[str, Any]] = []  # (for patches: the hosts that go complete)
        changes = []
        idx = indexes(state, now) if dirty else None
        for n in self.names:
            if n not in dirty:
                continue
            latest = self._latest[n]
            assert idx is not None
            self._tallies[n] = host_tally(latest, idx)
            if latest.error is None or latest.error.kind != "starting":
                # Ready counts what the document shows, not what is still to be folded.
                self.stats[n].answered = True
            h = annotated_host(latest, state, self.tracker, now)
            old = self._hosts.get(n)
            if h != old:
                self._hosts[n] = h
                changed.append(h)
                change = host_change(old, h) if patches else None
                if change is None:
                    whole.append(h)
                else:
                    changes.append(change)
        # (Counted again only when a host was: most folds of a quiet fleet change nothing.)
        other["summary"] = self._summary() if dirty else self._other.get("summary")
        was = self._other
        self._other = other
        moved = {k: other[k] for k in OTHER_KEYS if other.get(k) != was.get(k)}
        self.time = now
        if changed or moved:
            self.refreshes += 1
            t = iso(now)
            # No change a patch can carry (every host complete: the first answers, hosts
            # failing): the update itself, so the retained window keeps it once, not twice.
            self.on_update(dumps({"time": t, "hosts": changed, "removed": [], "set": moved}),
                           dumps({"time": t, "hosts": whole, "changes": changes,
                                  "removed": [], "set": moved}) if patches and changes
                           else None)
        self.fold_seconds += time.process_time() - t0

    def _refold_all(self) -> None:
        state, problem = self._read_reservations()
        now = utcnow()
        self._state_changed(state)
        idx = indexes(state, now)
        for n in self.names:
            self._hosts[n] = annotated_host(self._latest[n], state, self.tracker, now)
            self._tallies[n] = host_tally(self._latest[n], idx)
        self._other = self._other_keys(state, problem, now)
        self._other["summary"] = self._summary()

    def _summary(self) -> dict[str, Any]:
        """The document's ``summary``: the hosts' parts as last counted."""
        total = Tally()
        for n in self.names:
            total.add(self._tallies[n])
        return total.to_dict()

    def refresh_store(self) -> bool:
        """Read the shared file again if it changed (its signature: inode, size and mtime
        here; a checksum over SSH for a ``HOST:/path`` store); True when it was read.
        Blocking: the hub calls it on a worker thread, never in a fold (folds come up to
        ten times a second, a hostile 4 MiB file costs a tenth of a second to decode, and
        a store host that hangs must not stop the hub). An unchanged file, broken or not,
        is not read again."""
        try:
            sig = self.store.signature()
        except Exception:  # (a remote store's host may be down: read says why)
            sig = None
        if sig is not None and sig == self._read_sig:
            return False
        try:
            result: tuple[StoreState | None, str | None] = (self.store.read(), None)
        except StoreError as exc:
            result = (None, str(exc))
        self._read_sig, self._read_result = sig, result
        return True

    async def _watch_store(self) -> None:
        while True:
            if await asyncio.to_thread(self.refresh_store):
                self._kick.set()
            await asyncio.sleep(self.store_every_s)

    def _other_keys(self, state: StoreState | None, problem: str | None, now: datetime
                    ) -> dict[str, Any]:
        """The document's keys besides its hosts (OTHER_KEYS; None: absent). The list of
        reservations is made once per read of the file, not per fold (up to ten a second:
        a file of 10,000 reservations cost 0.4 s a fold, and every change of it went to
        every reader); readers skip those whose end has passed."""
        if state is None:
            return {"queue": None, "reservations": None, "reservations_error": problem}
        if self._listed is None or self._listed[0] is not state:
            self._listed = (state, reservations_document(state, now))
        return {"queue": queue_document(state, now), "reservations": self._listed[1],
                "reservations_error": problem}

    def _read_reservations(self) -> tuple[StoreState | None, str | None]:
        return self._read_result

    def _state_changed(self, state: StoreState | None) -> bool:
        key = None if state is None else (state.reservations, state.queue)
        if key == self._state_key:
            return False
        self._state_key = key
        return True


def age_seconds(then: datetime | None, now: datetime) -> float | None:
    return None if then is None else max(0.0, (now - then).total_seconds())
