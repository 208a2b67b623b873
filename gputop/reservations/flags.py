"""Reservations meet live data: who holds each GPU, misuse flags, and which GPUs are free.

Shared by ``gputop --json``, ``gputop free`` and the board so that all three agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from gputop.model import (
    SCHEMA_VERSION,
    FleetSnapshot,
    GpuInfo,
    HostSnapshot,
    MigInstance,
    iso,
    utcnow,
)
from gputop.reservations.store import Reservation, StoreState

#: Utilisation at or below this, with memory held, counts as "idle holder".
IDLE_UTIL_PERCENT = 2
#: A GPU with no processes using at most this much memory counts as free.
FREE_MEMORY_SLACK_MIB = 512
#: ``idle-reservation`` only after this long without a process of the holder on the GPU.
IDLE_GRACE_S = 15 * 60.0


def holds_memory_idle(g: GpuInfo) -> bool:
    return (bool(g.processes) and g.utilization_percent is not None
            and g.utilization_percent <= IDLE_UTIL_PERCENT)


def other_users(g: GpuInfo, me: str) -> list[str]:
    """Who else runs processes on this GPU (sorted; ``"?"`` for an owner nobody could tell):
    reserving it is allowed but deserves a warning, in the CLI and on the board alike."""
    return sorted({p.user or "?" for p in g.processes if p.user != me})


def _holder_present(g: GpuInfo, user: str) -> bool:
    # A process whose owner is unknown may be the holder's: never call that idle.
    return any(p.user == user or p.user is None for p in g.processes)


class IdleTracker:
    """Remembers since when each GPU has held memory at ~0 % utilisation, and when each
    user's processes were last seen on it (for the idle-reservation grace period)."""

    def __init__(self, after_s: float, grace_s: float = IDLE_GRACE_S) -> None:
        self.after_s = after_s
        self.grace_s = grace_s
        self._since: dict[tuple[str, int | None], datetime] = {}
        self._seen: dict[tuple[str, int | None], dict[str | None, datetime]] = {}

    def observe(self, host: HostSnapshot) -> None:
        if not host.ok:
            return
        name, t, since = host.name, host.time, self._since
        for g in host.gpus:
            if not g.processes:  # (the board calls this for every answer: kept cheap)
                if since:
                    since.pop((name, g.index), None)
                continue
            key = (name, g.index)
            if holds_memory_idle(g):
                since.setdefault(key, t)
            else:
                since.pop(key, None)
            seen = self._seen.get(key)
            if seen is None:
                seen = self._seen[key] = {}
            for p in g.processes:
                seen[p.user] = t

    def reservation_idle(self, host: str, g: GpuInfo, r: Reservation, now: datetime) -> bool:
        """True once no process of the holder was seen on the GPU for ``grace_s``: since the
        reservation was made, or since one was last seen, whichever is later."""
        if g.lost or _holder_present(g, r.user):
            return False
        seen = self._seen.get((host, g.index), {})
        last = max([r.created, *(t for u, t in seen.items() if u == r.user or u is None)])
        return (now - last).total_seconds() >= self.grace_s

    def idle_for(self, host: str, gpu: int | None, now: datetime) -> float:
        since = self._since.get((host, gpu))
        return 0.0 if since is None else (now - since).total_seconds()

    @property
    def idle_since(self) -> Mapping[tuple[str, int | None], datetime]:
        """Since when each GPU that holds memory idle now has done so, by (host, index)."""
        return self._since

    def is_idle_holder(self, host: str, gpu: int | None, now: datetime) -> bool:
        since = self._since.get((host, gpu))
        return since is not None and (now - since).total_seconds() >= self.after_s


def gpu_flags(g: GpuInfo, r: Reservation | None, idle_holder: bool,
              reservation_idle: bool = False) -> list[str]:
    """``reservation_idle`` comes from ``IdleTracker.reservation_idle`` (it needs history)."""
    if r is None and not idle_holder and not g.lost:
        return []  # (most GPUs, on every refresh of the board and of --watch)
    flags: list[str] = []
    if g.lost:
        flags.append("lost")
    if r is not None:
        if any(p.user and p.user != r.user for p in g.processes):
            flags.append("unreserved-use")
        if reservation_idle:
            flags.append("idle-reservation")
        if r.uuid and g.uuid and r.uuid != g.uuid:
            flags.append("renumbered")
    if idle_holder:
        flags.append("idle-holder")
    return flags


def reservation_index(state: StoreState | None, now: datetime
                      ) -> dict[tuple[str, int], Reservation]:
    """Whole-GPU reservations by (host, gpu)."""
    if state is None:
        return {}
    return {(r.host, r.gpu): r for r in state.active(now) if r.instance is None}


def instance_index(state: StoreState | None, now: datetime
                   ) -> dict[tuple[str, int, int], Reservation]:
    """MIG instance reservations by (host, gpu, GPU instance id)."""
    if state is None:
        return {}
    return {(r.host, r.gpu, r.instance): r for r in state.active(now) if r.instance is not None}


def instance_view(g: GpuInfo, inst: MigInstance) -> GpuInfo:
    """A MIG instance as a GPU of its own, for the rules that judge a GPU (flags, free):
    its processes and memory, no utilisation (NVML has none per instance)."""
    return replace(g, processes=inst.processes, memory_used_mib=inst.memory_used_mib,
                   memory_total_mib=inst.memory_total_mib, utilization_percent=None,
                   memory_utilization_percent=None, instances=())


def instance_reservation(held: dict[tuple[str, int], Reservation],
                         inst_held: dict[tuple[str, int, int], Reservation], host: str,
                         g: GpuInfo, inst: MigInstance) -> Reservation | None:
    """The instance's own reservation, else its GPU's (a whole-GPU one covers it)."""
    if g.index is None:
        return None
    own = (inst_held.get((host, g.index, inst.gpu_instance_id))
           if inst.gpu_instance_id is not None else None)
    return own or held.get((host, g.index))


#: What ``annotate`` adds to one GPU: its reservation, its flags, and the same per instance.
Annotation = tuple[Reservation | None, list[str],
                   tuple[tuple[Reservation | None, list[str]], ...]]


def gpu_annotation(host: str, g: GpuInfo, held: dict[tuple[str, int], Reservation],
                   inst_held: dict[tuple[str, int, int], Reservation],
                   tracker: IdleTracker | None, now: datetime) -> Annotation:
    """One GPU's reservation and flags (and its MIG instances'), as ``annotate`` adds them."""
    r = held.get((host, g.index)) if held and g.index is not None else None
    idle = tracker.is_idle_holder(host, g.index, now) if tracker else False
    unused = r is not None and tracker is not None and tracker.reservation_idle(host, g, r, now)
    insts = []
    for inst in g.instances:
        ir = instance_reservation(held, inst_held, host, g, inst)
        view = instance_view(g, inst)
        # The holder's processes are remembered per GPU: seen anywhere on it counts.
        iunused = (ir is not None and tracker is not None
                   and tracker.reservation_idle(host, view, ir, now))
        insts.append((ir, gpu_flags(view, ir, False, iunused)))
    return r, gpu_flags(g, r, idle, unused), tuple(insts)


def annotated_gpu(g: GpuInfo, ann: Annotation) -> dict[str, Any]:
    """A GPU's ``--json`` object: ``to_dict`` plus its annotation."""
    r, flags, insts = ann
    gdoc = g.to_dict()
    gdoc["reservation"] = r.to_dict() if r else None
    gdoc["flags"] = flags
    for (ir, iflags), idoc in zip(insts, gdoc["instances"]):
        idoc["reservation"] = ir.to_dict() if ir else None
        idoc["flags"] = iflags
    return gdoc


def annotate(snapshot: FleetSnapshot, state: StoreState | None,
             tracker: IdleTracker | None = None) -> dict[str, Any]:
    """The ``--json`` document: the snapshot plus, per GPU, its reservation and flags, and
    (version 3) the wait queue, in order, when the reservations file could be read."""
    now = snapshot.time
    doc: dict[str, Any] = {"version": SCHEMA_VERSION, "time": iso(snapshot.time),
           "hosts": [annotated_host(host, state, tracker, now) for host in snapshot.hosts]}
    if state is not None:
        doc["queue"] = queue_document(state, now)
    return doc


def annotated_host(host: HostSnapshot, state: StoreState | None,
                   tracker: IdleTracker | None, now: datetime) -> dict[str, Any]:
    """One host's object of the ``--json`` document (the hub rebuilds only hosts that
    answered anew)."""
    held = reservation_index(state, now)
    inst_held = instance_index(state, now)
    return host.head_dict() | {"gpus": [
        annotated_gpu(g, gpu_annotation(host.name, g, held, inst_held, tracker, now))
        for g in host.gpus]}


def queue_document(state: StoreState, now: datetime) -> list[dict[str, Any]]:
    """The waiters whose lease runs, first come first."""
    return [w.to_dict() for w in state.waiting(now)]


def is_free(g: GpuInfo) -> bool:
    """Nobody is using it: no processes, next to no memory, no load."""
    if g.lost or g.index is None or g.processes:
        return False
    if g.memory_used_mib is None or g.memory_used_mib > FREE_MEMORY_SLACK_MIB:
        return False
    return g.utilization_percent is None or g.utilization_percent <= 10


@dataclass(frozen=True)
class FreeGpu:
    """A free GPU, or a free MIG instance of one (``instance`` set)."""

    host: str
    gpu: GpuInfo
    instance: MigInstance | None = None

    @property
    def free_mib(self) -> int:
        return (self.instance or self.gpu).memory_free_mib

    @property
    def label(self) -> str:
        """``host:gpu`` or ``host:gpu/instance``, as ``reserve`` takes it."""
        gi = self.instance.gpu_instance_id if self.instance else None
        return f"{self.host}:{self.gpu.index}" + ("" if gi is None else f"/{gi}")


def free_gpus(hosts: Iterable[HostSnapshot], state: StoreState | None,
              min_free_mib: int = 0, now: datetime | None = None,
              user: str | None = None) -> list[FreeGpu]:
    """Free, unreserved GPUs (your own reservations count as free to you), best first:
    most free memory, then least load, then host and index."""
    now = now or utcnow()
    held = reservation_index(state, now)
    inst_held = instance_index(state, now)
    out = []
    for h in hosts:
        if not h.ok:
            continue
        for g in h.gpus:
            if g.index is not None and not g.lost:
                # A MIG GPU's free instances: unused, and held by nobody else (neither the
                # instance nor its whole GPU).
                for inst in g.instances:
                    r = instance_reservation(held, inst_held, h.name, g, inst)
                    if (inst.gpu_instance_id is None or not is_free(instance_view(g, inst))
                            or (r is not None and r.user != user)):
                        continue
                    f = FreeGpu(h.name, g, inst)
                    if f.free_mib >= min_free_mib:
                        out.append(f)
            if not is_free(g):
                continue
            r = held.get((h.name, g.index)) if g.index is not None else None
            if r is not None and r.user != user:
                continue
            if any(r.user != user for (hh, gi, _), r in inst_held.items()
                   if (hh, gi) == (h.name, g.index)):
                continue  # someone holds one of its instances
            f = FreeGpu(h.name, g)
            if f.free_mib >= min_free_mib:
                out.append(f)
    out.sort(key=lambda f: (-f.free_mib, f.gpu.utilization_percent or 0, f.host,
                            f.gpu.index or 0,
                            f.instance.gpu_instance_id or 0 if f.instance else -1))
    return out
