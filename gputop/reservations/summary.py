"""The fleet's one count: each GPU (and each MIG instance) in exactly one class.

Worked out once, here, and carried in the ``--json`` document's ``summary``: the board's
top line, ``--once``, the web page, ``/metrics`` and MCP all show it rather than counting
on their own (they disagreed on MIG GPUs and lost ones). The rule is in docs/json.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from gputop.model import GpuInfo, HostSnapshot
from gputop.reservations.flags import (
    FREE_MEMORY_SLACK_MIB,
    instance_index,
    instance_reservation,
    instance_view,
    reservation_index,
)
from gputop.reservations.records import Reservation
from gputop.reservations.shares import share_index
from gputop.reservations.state import StoreState

#: The classes, in the order every reader shows them.
CLASSES = ("free", "busy", "reserved", "shared", "down", "unknown")
#: The MIG instances' classes (a share is of a whole GPU, never of an instance).
INSTANCE_CLASSES = ("free", "busy", "reserved", "down", "unknown")


def use_class(g: GpuInfo) -> str:
    """What the live data alone says: ``busy`` (processes, memory or load), ``unknown``
    (no index, or its memory unreported: nobody can tell it is free) or ``free``; the
    same line as ``flags.is_free``."""
    if g.processes or (g.memory_used_mib is not None
                       and g.memory_used_mib > FREE_MEMORY_SLACK_MIB) or (
            g.utilization_percent is not None and g.utilization_percent > 10):
        return "busy"
    if g.index is None or g.memory_used_mib is None:
        return "unknown"
    return "free"


def instance_class(g: GpuInfo, view: GpuInfo, reserved: bool) -> str:
    """A MIG instance's class: down with its GPU, reserved (its own reservation or its
    GPU's), else what its processes and memory say."""
    if g.lost:
        return "down"
    if reserved:
        return "reserved"
    return use_class(view)


def gpu_class(g: GpuInfo, reserved: bool, shared: bool, instances: Iterable[str] = ()) -> str:
    """A whole GPU's one class, the first that applies: ``down`` (the driver lost it),
    ``reserved`` (a whole-GPU reservation), ``shared`` (memory shares), ``busy`` (it or
    any of its MIG instances is in use), ``reserved`` (an idle MIG GPU with a reserved
    instance), ``unknown``, ``free``. A MIG GPU is free only when all of it is: one with
    some free instances counts as busy or reserved, its free instances by instance."""
    if g.lost:
        return "down"
    if reserved:
        return "reserved"
    if shared:
        return "shared"
    insts = set(instances)
    use = use_class(g)
    if use == "busy" or "busy" in insts:
        return "busy"
    if "reserved" in insts:
        return "reserved"
    if use == "unknown" or "unknown" in insts:
        return "unknown"
    return "free"


@dataclass
class Tally:
    """Counts by class, of whole GPUs and of MIG instances, and hosts by state."""

    hosts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("up", "down", "waiting"), 0))
    gpus: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    instances: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(INSTANCE_CLASSES, 0))

    def add(self, other: Tally) -> None:
        for mine, theirs in ((self.hosts, other.hosts), (self.gpus, other.gpus),
                             (self.instances, other.instances)):
            for k, v in theirs.items():
                mine[k] += v

    def to_dict(self) -> dict[str, Any]:
        return {"hosts": dict(self.hosts),
                "gpus": {"total": sum(self.gpus.values())} | self.gpus,
                "instances": {"total": sum(self.instances.values())} | self.instances}


Indexes = tuple[dict[tuple[str, int], Reservation], dict[tuple[str, int, int], Reservation],
                dict[tuple[str, int], tuple[Reservation, ...]]]


def indexes(state: StoreState | None, now: datetime) -> Indexes:
    """Whole-GPU reservations, instance reservations and shares, for ``host_tally``."""
    return reservation_index(state, now), instance_index(state, now), share_index(state, now)


def host_tally(host: HostSnapshot, idx: Indexes) -> Tally:
    """One host's part of the summary. A host in error is down (``starting``: waiting),
    and its GPUs, unreported, are in no class."""
    t = Tally()
    if host.error is not None:
        t.hosts["waiting" if host.error.kind == "starting" else "down"] += 1
        return t
    t.hosts["up"] += 1
    for g in host.gpus:
        c, insts = classes(host.name, g, idx)
        t.gpus[c] += 1
        for ic in insts:
            t.instances[ic] += 1
    return t


def classes(host: str, g: GpuInfo, idx: Indexes) -> tuple[str, list[str]]:
    """One GPU's class and its MIG instances', under these reservations."""
    held, inst_held, shared = idx
    insts = [instance_class(g, instance_view(g, inst),
                            instance_reservation(held, inst_held, host, g, inst) is not None)
             for inst in g.instances] if g.instances else []
    key = (host, g.index) if g.index is not None else None
    return gpu_class(g, key is not None and key in held,
                     key is not None and bool(shared.get(key)), insts), insts


def fleet_summary(hosts: Iterable[HostSnapshot], state: StoreState | None,
                  now: datetime) -> dict[str, Any]:
    """The document's ``summary`` of these hosts under these reservations."""
    idx = indexes(state, now)
    total = Tally()
    for h in hosts:
        total.add(host_tally(h, idx))
    return total.to_dict()
