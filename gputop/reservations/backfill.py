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

import heapq
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


def candidates(hosts: Iterable[HostSnapshot], when: Mapping[Key, datetime]
               ) -> dict[str, list[tuple[Key, GpuInfo | None]]]:
    """The whole GPUs the queue could ever hand out whose free time is known, by host
    (worked out once for every waiter's :func:`turn`): those of the hosts that answered,
    and the reserved ones of hosts not asked (what the file tells; size unknown)."""
    out: dict[str, list[tuple[Key, GpuInfo | None]]] = {}
    asked = set()
    for h in hosts:
        asked.add(h.name)
        if h.ok:
            out[h.name] = [((h.name, g.index), g) for g in h.gpus if g.index is not None
                           and (h.name, g.index) in when and not mig_mode(g)]
    for k in when:
        if k[0] not in asked:
            out.setdefault(k[0], []).append((k, None))
    return out


def sized_keys(gpus: Mapping[str, list[tuple[Key, GpuInfo | None]]],
               sized: Callable[[GpuInfo], bool]) -> frozenset[Key]:
    """The GPUs of ``gpus`` that are ``sized`` for a request (one of unknown size is)."""
    return frozenset(k for v in gpus.values() for k, g in v if g is None or sized(g))


def turn(count: int, one_host: bool, sized: frozenset[Key], on: set[str],
         gpus: Mapping[str, list[tuple[Key, GpuInfo | None]]],
         when: Mapping[Key, datetime]) -> Turn:
    """The turn of a waiter for ``count`` GPUs (``one_host``: all on one host) among
    those ``sized`` for it (:func:`sized_keys`) on hosts ``on``, of ``gpus``
    (:func:`candidates`), given when each is free (``when``)."""
    ends = [[(when[k], k) for k, _ in gpus.get(h, ()) if k in sized] for h in on]
    groups = ends if one_host else [[e for v in ends for e in v]]
    firsts: list[tuple[datetime, list[tuple[datetime, Key]]]] = []
    for group in groups:
        if len(group) >= count:
            firsts.append((heapq.nsmallest(count, group)[-1][0], group))
    if not firsts:
        return Turn(None)
    best = min(t for t, _ in firsts)
    return Turn(best, frozenset(k for t, group in firsts if t == best
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
