"""Reservations meet live data: who holds each GPU, misuse flags, and which GPUs are free.

Shared by ``gputop --json``, ``gputop free`` and the board so that all three agree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gputop.model import FleetSnapshot, GpuInfo, HostSnapshot, utcnow
from gputop.reservations.store import Reservation, StoreState

#: Utilisation at or below this, with memory held, counts as "idle holder".
IDLE_UTIL_PERCENT = 2
#: A GPU with no processes using at most this much memory counts as free.
FREE_MEMORY_SLACK_MIB = 512


def holds_memory_idle(g: GpuInfo) -> bool:
    return (bool(g.processes) and g.utilization_percent is not None
            and g.utilization_percent <= IDLE_UTIL_PERCENT)


class IdleTracker:
    """Remembers since when each GPU has held memory at ~0 % utilisation."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self._since: dict[tuple[str, int | None], datetime] = {}

    def observe(self, host: HostSnapshot) -> None:
        if not host.ok:
            return
        for g in host.gpus:
            key = (host.name, g.index)
            if holds_memory_idle(g):
                self._since.setdefault(key, host.time)
            else:
                self._since.pop(key, None)

    def idle_for(self, host: str, gpu: int | None, now: datetime) -> float:
        since = self._since.get((host, gpu))
        return 0.0 if since is None else (now - since).total_seconds()

    def is_idle_holder(self, host: str, gpu: int | None, now: datetime) -> bool:
        since = self._since.get((host, gpu))
        return since is not None and (now - since).total_seconds() >= self.after_s


def gpu_flags(g: GpuInfo, r: Reservation | None, idle_holder: bool) -> list[str]:
    flags: list[str] = []
    if g.lost:
        flags.append("lost")
    if r is not None:
        if any(p.user and p.user != r.user for p in g.processes):
            flags.append("unreserved-use")
        if not g.processes and not g.lost:
            flags.append("idle-reservation")
        if r.uuid and g.uuid and r.uuid != g.uuid:
            flags.append("renumbered")
    if idle_holder:
        flags.append("idle-holder")
    return flags


def reservation_index(state: StoreState | None, now: datetime
                      ) -> dict[tuple[str, int], Reservation]:
    if state is None:
        return {}
    return {(r.host, r.gpu): r for r in state.active(now)}


def annotate(snapshot: FleetSnapshot, state: StoreState | None,
             tracker: IdleTracker | None = None) -> dict[str, Any]:
    """The ``--json`` document: the snapshot plus, per GPU, its reservation and flags."""
    now = snapshot.time
    held = reservation_index(state, now)
    doc = snapshot.to_dict()
    for host, hdoc in zip(snapshot.hosts, doc["hosts"]):
        for g, gdoc in zip(host.gpus, hdoc["gpus"]):
            r = held.get((host.name, g.index)) if g.index is not None else None
            idle = tracker.is_idle_holder(host.name, g.index, now) if tracker else False
            gdoc["reservation"] = r.to_dict() if r else None
            gdoc["flags"] = gpu_flags(g, r, idle)
    return doc


def is_free(g: GpuInfo) -> bool:
    """Nobody is using it: no processes, next to no memory, no load."""
    if g.lost or g.index is None or g.processes:
        return False
    if g.memory_used_mib is None or g.memory_used_mib > FREE_MEMORY_SLACK_MIB:
        return False
    return g.utilization_percent is None or g.utilization_percent <= 10


@dataclass(frozen=True)
class FreeGpu:
    host: str
    gpu: GpuInfo

    @property
    def free_mib(self) -> int:
        return self.gpu.memory_free_mib


def free_gpus(hosts: Iterable[HostSnapshot], state: StoreState | None,
              min_free_mib: int = 0, now: datetime | None = None,
              user: str | None = None) -> list[FreeGpu]:
    """Free, unreserved GPUs (your own reservations count as free to you), best first:
    most free memory, then least load, then host and index."""
    now = now or utcnow()
    held = reservation_index(state, now)
    out = []
    for h in hosts:
        if not h.ok:
            continue
        for g in h.gpus:
            if not is_free(g):
                continue
            r = held.get((h.name, g.index)) if g.index is not None else None
            if r is not None and r.user != user:
                continue
            f = FreeGpu(h.name, g)
            if f.free_mib >= min_free_mib:
                out.append(f)
    out.sort(key=lambda f: (-f.free_mib, f.gpu.utilization_percent or 0, f.host,
                            f.gpu.index or 0))
    return out
