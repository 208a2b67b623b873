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
from gputop.reservations.records import Reservation
from gputop.reservations.shares import (
    ShareFit,
    best_fit,
    holder_use_mib,
    mig_mode,
    room_mib,
    share_dict,
    share_index,
)
from gputop.reservations.state import StoreState

#: Utilisation at or below this, with memory held, counts as "idle holder".
IDLE_UTIL_PERCENT = 2
#: A GPU with no processes using at most this much memory counts as free.
FREE_MEMORY_SLACK_MIB = 512
#: ``idle-reservation`` only after this long without a process of the holder on the GPU.
IDLE_GRACE_S = 15 * 60.0
#: ``over-share`` only after a holder's processes used more than their share this long.
SHARE_GRACE_S = 5 * 60.0


def holds_memory_idle(g: GpuInfo) -> bool:
    return (bool(g.processes) and g.utilization_percent is not None
            and g.utilization_percent <= IDLE_UTIL_PERCENT)


def other_users(g: GpuInfo, me: str, login: str | None = None) -> list[str]:
    """Who else runs processes on this GPU (sorted; ``"?"`` for an owner nobody could tell):
    reserving it is allowed but deserves a warning, in the CLI and on the board alike.
    ``login``: the account you log in as on its host (your processes there are its)."""
    mine = {me} if login is None else {me, login}
    return sorted({p.user or "?" for p in g.processes if p.user is None or p.user not in mine})


def _holder_present(g: GpuInfo, r: Reservation) -> bool:
    # A process whose owner is unknown may be the holder's: never call that idle.
    return any(p.user is None or r.is_holder(p.user) for p in g.processes)


class IdleTracker:
    """Remembers since when each GPU has held memory at ~0 % utilisation, and when each
    user's processes were last seen on it (for the idle-reservation grace period)."""

    def __init__(self, after_s: float, grace_s: float = IDLE_GRACE_S,
                 share_grace_s: float = SHARE_GRACE_S) -> None:
        self.after_s = after_s
        self.grace_s = grace_s
        self.share_grace_s = share_grace_s
        self._since: dict[tuple[str, int | None], datetime] = {}
        self._seen: dict[tuple[str, int | None], dict[str | None, datetime]] = {}
        #: Since when each share's holder has used more than the share, by (host, gpu, user).
        self._over: dict[tuple[str, int | None, str], datetime] = {}

    def observe(self, host: HostSnapshot) -> None:
        if not host.ok:
            return
        # (The board calls this for every answer, for every GPU: kept cheap, with
        # holds_memory_idle inline and one key per GPU.)
        name, t, since, seen_by = host.name, host.time, self._since, self._seen
        for g in host.gpus:
            processes = g.processes
            if not processes:
                if since:
                    since.pop((name, g.index), None)
                continue
            key = (name, g.index)
            util = g.utilization_percent
            if util is not None and util <= IDLE_UTIL_PERCENT:  # (holds_memory_idle)
                if key not in since:
                    since[key] = t
            elif since:
                since.pop(key, None)
            seen = seen_by.get(key)
            if seen is None:
                seen = seen_by[key] = {}
            for p in processes:
                seen[p.user] = t

    def reservation_idle(self, host: str, g: GpuInfo, r: Reservation, now: datetime) -> bool:
        """True once no process of the holder was seen on the GPU for ``grace_s``: since the
        reservation was made, or since one was last seen, whichever is later."""
        if g.lost or _holder_present(g, r):
            return False
        seen = self._seen.get((host, g.index), {})
        last = max([r.created, *(t for u, t in seen.items() if u is None or r.is_holder(u))])
        return (now - last).total_seconds() >= self.grace_s

    def over_share(self, host: str, g: GpuInfo, r: Reservation, now: datetime) -> bool:
        """True once the share's holder has used more than the share for
        ``share_grace_s`` (as seen by the calls here: every refresh asks)."""
        key = (host, g.index, r.user)
        if g.lost or r.share_mib is None or holder_use_mib(g, r) <= r.share_mib:
            self._over.pop(key, None)
            return False
        since = self._over.setdefault(key, now)
        return (now - since).total_seconds() >= self.share_grace_s

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
        if any(p.user and not r.is_holder(p.user) for p in g.processes):
            flags.append("unreserved-use")
        if reservation_idle:
            flags.append("idle-reservation")
        if r.uuid and g.uuid and r.uuid != g.uuid:
            flags.append("renumbered")
        if r.beyond_max:
            flags.append("beyond-max")
    if idle_holder:
        flags.append("idle-holder")
    return flags


def reservation_index(state: StoreState | None, now: datetime
                      ) -> dict[tuple[str, int], Reservation]:
    """Whole-GPU reservations by (host, gpu) (shares: ``shares.share_index``)."""
    if state is None:
        return {}
    return {(r.host, r.gpu): r for r in state.active(now)
            if r.instance is None and r.share_mib is None}


def instance_index(state: StoreState | None, now: datetime
                   ) -> dict[tuple[str, int, int], Reservation]:
    """MIG instance reservations by (host, gpu, GPU instance id)."""
    if state is None:
        return {}
    return {(r.host, r.gpu, r.instance): r for r in state.active(now) if r.instance is not None}


def uuid_index(state: StoreState | None, now: datetime
               ) -> dict[str, list[tuple[str, int | None]]]:
    """Where each reserved GPU uuid is reserved: [(host name, instance or None)], so that
    a GPU a teammate's config calls by another host name is not free under this one."""
    out: dict[str, list[tuple[str, int | None]]] = {}
    if state is None:
        return out
    for r in state.active(now):
        if r.uuid:
            out.setdefault(r.uuid, []).append((r.host, r.instance))
    return out


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


def share_flags(host: str, g: GpuInfo, shares: tuple[Reservation, ...],
                tracker: IdleTracker | None, now: datetime
                ) -> tuple[list[str], list[list[str]]]:
    """A shared GPU's flags, and each share's: ``unreserved-use`` (a process of someone
    who holds no share of it), ``over-share`` (a holder's processes used more than the
    share for the grace), ``idle-reservation`` (no process of the holder for
    ``idle_grace``), ``renumbered``, ``lost``."""
    # A holder's processes are known by either name (``Reservation.is_holder``).
    holders = {r.user for r in shares} | {r.login for r in shares if r.login}
    per: list[list[str]] = []
    for r in shares:
        f: list[str] = []
        if tracker is not None and tracker.over_share(host, g, r, now):
            f.append("over-share")
        if tracker is not None and tracker.reservation_idle(host, g, r, now):
            f.append("idle-reservation")
        if r.uuid and g.uuid and r.uuid != g.uuid:
            f.append("renumbered")
        per.append(f)
    flags = ["lost"] if g.lost else []
    if any(p.user and p.user not in holders for p in g.processes):
        flags.append("unreserved-use")
    flags.extend(dict.fromkeys(x for f in per for x in f))
    return flags, per


def unshared_mib(g: GpuInfo, shares: tuple[Reservation, ...]) -> int | None:
    """The shared GPU's memory no share holds (None: its total is unknown)."""
    return None if g.memory_total_mib is None else room_mib(g.memory_total_mib, shares)


def annotated_gpu(g: GpuInfo, ann: Annotation) -> dict[str, Any]:
    """A GPU's ``--json`` object: ``to_dict`` plus its annotation."""
    r, flags, insts = ann
    gdoc = g.to_dict()
    gdoc["reservation"] = r.to_dict() if r else None
    gdoc["flags"] = flags
    gdoc["shares"] = []
    gdoc["unshared_mib"] = None
    for (ir, iflags), idoc in zip(insts, gdoc["instances"]):
        idoc["reservation"] = ir.to_dict() if ir else None
        idoc["flags"] = iflags
    return gdoc


def annotated_shared_gpu(host: str, g: GpuInfo, shares: tuple[Reservation, ...],
                         tracker: IdleTracker | None, now: datetime) -> dict[str, Any]:
    """A shared GPU's ``--json`` object: its shares (holder, size, what the holder's
    processes use now, time left, flags), the unshared rest and the GPU's flags."""
    flags, per = share_flags(host, g, shares, tracker, now)
    idle = tracker.is_idle_holder(host, g.index, now) if tracker else False
    gdoc = annotated_gpu(g, (None, flags + (["idle-holder"] if idle else []), ()))
    gdoc["shares"] = [share_dict(r, g, now) | {"flags": f} for r, f in zip(shares, per)]
    gdoc["unshared_mib"] = unshared_mib(g, shares)
    return gdoc


def annotate(snapshot: FleetSnapshot, state: StoreState | None,
             tracker: IdleTracker | None = None) -> dict[str, Any]:
    """The ``--json`` document: the snapshot plus, per GPU, its reservation and flags (and
    a shared GPU's shares), and the wait queue, in order, when the reservations file could
    be read. (Its ``summary`` is the caller's: ``summary.fleet_summary``.)"""
    now = snapshot.time
    doc: dict[str, Any] = {"version": SCHEMA_VERSION, "time": iso(snapshot.time),
           "hosts": [annotated_host(host, state, tracker, now) for host in snapshot.hosts]}
    if state is not None:
        doc.update(shared_keys(state, now))
    return doc


def shared_keys(state: StoreState, now: datetime) -> dict[str, Any]:
    """The document's keys from the shared file alone: the wait queue and every active
    reservation (``reservations_document``)."""
    return {"queue": queue_document(state, now),
            "reservations": reservations_document(state, now)}


def reservations_document(state: StoreState, now: datetime) -> list[dict[str, Any]]:
    """Every reservation active at ``now``: a GPU's own shows only those of GPUs a host
    reported, and a host that is down reports none (its holders would vanish from every
    reader). Each says when it ends: a reader skips one whose end has passed, so a hub
    lists them again only when the file changes, not at every expiry."""
    return [r.to_dict() for r in state.active(now)]


def annotated_host(host: HostSnapshot, state: StoreState | None,
                   tracker: IdleTracker | None, now: datetime) -> dict[str, Any]:
    """One host's object of the ``--json`` document (the hub rebuilds only hosts that
    answered anew)."""
    held = reservation_index(state, now)
    inst_held = instance_index(state, now)
    shared = share_index(state, now)
    return host.head_dict() | {"gpus": [
        annotated_shared_gpu(host.name, g, sh, tracker, now)
        if shared and g.index is not None and (sh := shared.get((host.name, g.index)))
        else annotated_gpu(g, gpu_annotation(host.name, g, held, inst_held, tracker, now))
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
    shared = share_index(state, now)
    aliases = uuid_index(state, now)
    out = []
    for h in hosts:
        if not h.ok:
            continue
        for g in h.gpus:
            if shared and (h.name, g.index) in shared:
                continue  # shared: not whole (anyone's, yours too: see ``share_fits``)
            alias = [i for host, i in aliases.get(g.uuid or "", ()) if host != h.name]
            if None in alias:
                continue  # reserved whole, or shared, under another host name
            if g.index is not None and not g.lost:
                # A MIG GPU's free instances: unused, and held by nobody else (neither the
                # instance nor its whole GPU).
                for inst in g.instances:
                    r = instance_reservation(held, inst_held, h.name, g, inst)
                    if (inst.gpu_instance_id is None or not is_free(instance_view(g, inst))
                            or (r is not None and r.user != user)
                            or inst.gpu_instance_id in alias):
                        continue
                    f = FreeGpu(h.name, g, inst)
                    if f.free_mib >= min_free_mib:
                        out.append(f)
            if not is_free(g) or alias:
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


def share_fits(hosts: Iterable[HostSnapshot], state: StoreState | None, share_mib: int,
               now: datetime | None = None, user: str | None = None) -> list[ShareFit]:
    """The GPUs a share of ``share_mib`` fits on now, best fit first (``shares.best_fit``):
    a shared GPU with that much room left unshared and free on the GPU itself (not MIG,
    no whole reservation, no share of yours: that one you resize with ``reserve``), else an
    untouched GPU (free and held by nobody)."""
    now = now or utcnow()
    held = reservation_index(state, now)
    inst_held = instance_index(state, now)
    shared = share_index(state, now)
    aliases = uuid_index(state, now)
    out: list[ShareFit] = []
    for h in hosts:
        if not h.ok:
            continue
        for g in h.gpus:
            if (g.index is None or g.lost or g.memory_total_mib is None or mig_mode(g)
                    or (h.name, g.index) in held
                    or any((hh, gi) == (h.name, g.index) for hh, gi, _ in inst_held)
                    or any(host != h.name for host, _ in aliases.get(g.uuid or "", ()))):
                continue
            sh = shared.get((h.name, g.index), ())
            if any(r.user == user for r in sh):
                continue
            room = room_mib(g.memory_total_mib, sh)
            if sh:
                if room >= share_mib and g.memory_free_mib >= share_mib:
                    out.append(ShareFit(h.name, g, room, sh))
            elif is_free(g) and room >= share_mib:
                out.append(ShareFit(h.name, g, room))
    return best_fit(out)
