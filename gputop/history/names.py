"""Which user names history keeps, so that its size does not depend on the names that arrive.

Process owners come from other machines and holders from a file anyone can write: a new
name every refresh must not cost a new set of rows every refresh (users, and per-minute,
per-hour and per-day sums). So:

- a name is kept (gets its own id) once it is seen in two refreshes in a row, as a process
  owner or as a holder, and then from its first refresh on (the recorder writes the
  samples of its first refreshes again); a name seen for a single refresh is never kept;
- new names are admitted at most ``NEW_NAMES_BURST`` at once, then one per
  ``NEW_NAME_EVERY_S`` of recorded time: a flood waits (or is never admitted);
- a rollup keeps the ``MAX_NAMED`` busiest names of each GPU in each minute, hour and day
  and sums the rest into one row.

Time of a name not kept counts under ``OTHER_NAMES``: GPU totals and the names kept are
exact, and only the names are lost. A name already in the database is kept at once.

GPUs likewise (``GpuGate``): a host's new GPU uuids (a row each in ``gpus``) are admitted
at most ``NEW_GPUS_BURST`` at once, then one per ``NEW_GPU_EVERY_S`` per host; a GPU not
admitted is left out of its samples until it is. A host reporting new uuids every
refresh grows the table by at most 24 rows a day.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gputop.history.accounting import RESERVED, UNKNOWN_USER, USED

#: The name time of names not kept counts under. It has a space, which no process owner
#: (a ``ps`` column) nor holder (a reservations-file name) can have.
OTHER_NAMES = "(other names)"
NEW_NAMES_BURST = 64
NEW_NAME_EVERY_S = 60.0
#: Names of one GPU kept per rollup bucket (minute, hour, day); the rest are summed.
MAX_NAMED = 16
#: Names waiting for their second refresh, at most (memory only).
PENDING_MAX = 4096
#: New GPUs per host: more than any machine has at once, then one an hour.
NEW_GPUS_BURST = 64
NEW_GPU_EVERY_S = 3600.0


class GpuGate:
    """Per-host token buckets for GPUs new to the database (see the module)."""

    def __init__(self) -> None:
        self._buckets: dict[int, tuple[float, int]] = {}  # host id -> (tokens, at ms)

    def take(self, host: int, t_ms: int) -> bool:
        """Whether a new GPU of ``host`` seen at ``t_ms`` gets its row now."""
        tokens, at = self._buckets.get(host, (float(NEW_GPUS_BURST), t_ms))
        if t_ms > at:
            tokens = min(float(NEW_GPUS_BURST),
                         tokens + (t_ms - at) / 1000 / NEW_GPU_EVERY_S)
            at = t_ms
        if tokens < 1.0:
            self._buckets[host] = (tokens, at)
            return False
        self._buckets[host] = (tokens - 1.0, at)
        return True


class NameGate:
    """Maps names to user ids, admitting new names by the rules above.

    ``known`` (name -> id, shared with the recorder) holds the names kept; ``add`` inserts a
    name into the database and returns its id. ``t_ms`` is the sample's time.
    """

    def __init__(self, known: dict[str, int], add: Callable[[str], int], *,
                 interval_ms: int, max_gap_ms: int) -> None:
        self.known, self._add = known, add
        self.half_ms, self.max_gap_ms = interval_ms // 2, max_gap_ms
        self._pending: dict[str, tuple[int, int]] = {}  # name -> (first seen, last seen)
        self._tokens = float(NEW_NAMES_BURST)
        self._tokens_at: int | None = None
        self._purged_at: int | None = None
        #: Names of the sample being built that count under OTHER_NAMES for now, and names
        #: just kept: the recorder writes those samples again (``Recorder._revisit``).
        self.waiting: set[str] = set()
        self.admitted: set[str] = set()
        #: Writing a sample again: look names up, change nothing.
        self.replaying = False

    def others(self) -> int:
        return self._kept(OTHER_NAMES)

    def _kept(self, name: str) -> int:
        got = self.known.get(name)
        if got is None:
            got = self.known[name] = self._add(name)
        return got

    def resolve(self, name: str, t_ms: int) -> int:
        """The id ``name``'s time counts under in a sample at ``t_ms``."""
        got = self.known.get(name)
        if got is not None:
            return got
        if name in (UNKNOWN_USER, OTHER_NAMES):
            return self._kept(name)
        if self.replaying:
            return self.others()
        first, last = self._pending.get(name, (t_ms, t_ms))
        if t_ms - last > self.max_gap_ms:  # not seen in the refresh before: start again
            first = last = t_ms
        last = max(last, t_ms)
        if t_ms - first >= self.half_ms and self._take(t_ms):
            self._pending.pop(name, None)
            self.admitted.add(name)
            return self._kept(name)
        if name in self._pending or self._room(t_ms):
            self._pending[name] = (first, last)
            self.waiting.add(name)
        return self.others()

    def _take(self, t_ms: int) -> bool:
        if self._tokens_at is not None and t_ms > self._tokens_at:
            self._tokens = min(float(NEW_NAMES_BURST), self._tokens + (
                t_ms - self._tokens_at) / 1000 / NEW_NAME_EVERY_S)
        self._tokens_at = t_ms if self._tokens_at is None else max(self._tokens_at, t_ms)
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def _room(self, t_ms: int) -> bool:
        if len(self._pending) >= PENDING_MAX and t_ms != self._purged_at:
            self._purged_at = t_ms  # once per sample time: a flood costs one pass, not one
            self.purge(t_ms)  # per name
        return len(self._pending) < PENDING_MAX

    def purge(self, t_ms: int) -> None:
        """Forget names not seen in the last refresh (they start again if they come back)."""
        self._pending = {n: fl for n, fl in self._pending.items()
                         if t_ms - fl[1] <= self.max_gap_ms}

    def user_ids(self, names: Iterable[str], t_ms: int) -> list[int]:
        """The ids of a GPU's users: each distinct name once, so that equal shares stay
        right (two names not kept are two shares of ``OTHER_NAMES``)."""
        ids: set[int] = set()
        new: set[str] = set()
        for n in names:
            i = self.known.get(n)
            if i is None:
                new.add(n)
            else:
                ids.add(i)
        if not new:  # the common case: every name known
            return sorted(ids)
        others, n_others = self.others(), 0
        for n in new:
            i = self.resolve(n, t_ms)
            if i == others:
                n_others += 1
            else:
                ids.add(i)
        if others in ids:  # the name OTHER_NAMES itself (no host or file can send it)
            ids.discard(others)
            n_others += 1
        return sorted(ids) + [others] * n_others


def fold(users: dict[int, list[float]], others: int) -> dict[int, list[float]]:
    """One GPU's user sums for one bucket with at most ``MAX_NAMED`` names besides
    ``others``: the least used and reserved are added into ``others``."""
    named = [u for u in users if u != others]
    if len(named) <= MAX_NAMED:
        return users
    named.sort(key=lambda u: (-(users[u][USED] + users[u][RESERVED]), u))
    out = {u: users[u] for u in named[:MAX_NAMED]}
    rest = list(users.get(others, [0.0] * len(next(iter(users.values())))))
    for u in named[MAX_NAMED:]:
        for i, v in enumerate(users[u]):
            rest[i] += v
    out[others] = rest
    return out
