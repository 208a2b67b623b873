"""Backfill: when a waiter could be served at the earliest, and which GPUs it would take.

A waiter for more GPUs than are free now needs to wait for reservations to end. Until then
the GPUs it will take (those free now and those whose reservations end first) may still
serve someone else, as long as that someone is done before the waiter's turn comes: the
waiter is served no later for it (Slurm's backfill). This module works out that turn from
what is known: a free GPU is free now, a reserved one when its last reservation ends (as
this reader bounds it, see ``StoreState.ends``), and a GPU an earlier waiter will be given
is free again only after that waiter's turn plus the longest reservation there is. A GPU
busy without a reservation, or on a host that did not answer, has no known end: a waiter
that needs such GPUs has no turn that can be told (``Turn.at`` None), and everything it
could use waits for it, as without backfill.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from gputop.model import GpuInfo, HostSnapshot
from gputop.reservations.flags import FreeGpu
from gputop.reservations.shares import mig_mode
from gputop.reservations.state import StoreState

#: How long a GPU given to a waiter is assumed held when the reader sets no
#: ``max_duration``: the longest a reservation may run (7 days).
LONGEST_S = 7 * 24 * 3600.0

Key = tuple[str, int]


@dataclass(frozen=True)
class Turn:
    """The earliest time a waiter could be served (None: not known) and the GPUs it would
    take then (every GPU it could use that is free by then)."""

    at: datetime | None
    gpus: frozenset[Key] = frozenset()


def free_at(state: StoreState, hosts: Iterable[HostSnapshot], now: datetime,
            free: Iterable[FreeGpu]) -> dict[Key, datetime]:
    """When each whole GPU is free for the queue, where that is known: now for the free
    ones, the end of their last reservation for reserved ones (on a host this reader did
    not ask, e.g. ``reserve`` asks only the hosts it names, the file still tells)."""
    hosts = list(hosts)
    asked = {h.name for h in hosts}
    known = {(h.name, g.index) for h in hosts if h.ok for g in h.gpus if g.index is not None}
    out: dict[Key, datetime] = {}
    for r in state.active(now):
        k = (r.host, r.gpu)
        if k in known or r.host not in asked:
            out[k] = max(out.get(k, now), state.ends(r, now))
    for f in free:
        if f.instance is None and f.gpu.index is not None:
            out[(f.host, f.gpu.index)] = now
    return out


def turn(count: int, one_host: bool, sized: Callable[[GpuInfo], bool], on: set[str],
         hosts: Iterable[HostSnapshot], when: Mapping[Key, datetime]) -> Turn:
    """The turn of a waiter for ``count`` GPUs (``one_host``: all on one host) that are
    ``sized`` for it, on hosts ``on``, given when each GPU is free (``when``)."""
    ends: dict[str, list[tuple[datetime, Key]]] = {}
    asked = set()
    for h in hosts:
        asked.add(h.name)
        if not h.ok or h.name not in on:
            continue
        for g in h.gpus:
            k = (h.name, g.index or 0)
            if g.index is not None and sized(g) and not mig_mode(g) and k in when:
                ends.setdefault(h.name, []).append((when[k], k))
    for k, t in when.items():  # reserved GPUs of hosts not asked: what the file tells
        if k[0] in on and k[0] not in asked:
            ends.setdefault(k[0], []).append((t, k))
    groups = list(ends.values()) if one_host else [[e for v in ends.values() for e in v]]
    best: datetime | None = None
    for group in groups:
        if len(group) >= count:
            t = sorted(e for e, _ in group)[count - 1]
            best = t if best is None else min(best, t)
    if best is None:
        return Turn(None)
    return Turn(best, frozenset(k for group in groups if len(group) >= count
                                and sorted(e for e, _ in group)[count - 1] == best
                                for e, k in group if e <= best))


def held_after(t: Turn, state: StoreState, when: dict[Key, datetime]) -> None:
    """Mark the GPUs of a waiter's turn as busy until it is done with them (its turn plus
    the longest reservation this reader allows), for the waiters behind it."""
    if t.at is None:
        return
    until = t.at + timedelta(seconds=state.max_s or LONGEST_S)
    for k in t.gpus:
        when[k] = until


def delays(t: Turn, key: Key, now: datetime, end: datetime | None) -> bool:
    """Whether taking GPU ``key`` until ``end`` (None: for good) could delay a waiter with
    turn ``t`` that could use it: always if its turn is now or unknown; else only a GPU of
    its turn kept past that turn."""
    if t.at is None or t.at <= now:
        return True
    return key in t.gpus and (end is None or end > t.at)
