"""How ``gputop mcp``'s results write things out: GPUs, reservations, waiters, found GPUs.

Every string that comes from elsewhere goes through :func:`data` (control and escape
characters dropped, cut to a bound); lists are capped. ``me`` marks what is yours.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from gputop.model import GpuInfo, HostSnapshot, MigInstance, ProcessInfo, iso
from gputop.reservations.flags import Annotation, FreeGpu, is_free, unshared_mib
from gputop.reservations.ops import format_duration
from gputop.reservations.records import Reservation, Waiter
from gputop.reservations.shares import ShareFit
from gputop.text import clean

#: Processes listed per GPU (the rest are counted).
MAX_PROCESSES = 8
#: Characters kept of a process's command line; of a note or an error message.
MAX_COMMAND = 120
MAX_TEXT = 200


def data(text: str | None, limit: int = MAX_TEXT) -> str | None:
    """Untrusted text as data: control and escape characters dropped, cut to ``limit``."""
    if text is None:
        return None
    t = clean(text)
    return t if len(t) <= limit else t[: limit - 1] + "…"


def left(until: datetime, now: datetime) -> str:
    return format_duration(max(0.0, (until - now).total_seconds()))


def reservation_doc(r: Reservation, now: datetime, me: str) -> dict[str, Any]:
    doc = {"gpu": r.target, "user": data(r.user, 64), "mine": r.user == me,
           "until": iso(r.expires), "left": left(r.expires, now), "note": data(r.note),
           "job_pid": r.job.pid if r.job else None}
    if r.share_mib is not None:
        doc["share_mib"] = r.share_mib
    return doc


def waiter_doc(w: Waiter, position: int, me: str) -> dict[str, Any]:
    return {"position": position, "id": w.id, "user": data(w.user, 64), "mine": w.user == me,
            "count": w.count, "min_free_mib": w.min_free_mib, "share_mib": w.share_mib,
            "hosts": [data(h, 64) for h in w.hosts[:16]], "one_host": w.one_host,
            "want": data(w.want, 80), "since": iso(w.created)}


def processes_doc(ps: Sequence[ProcessInfo]) -> dict[str, Any]:
    shown = [{"pid": p.pid, "user": data(p.user, 64), "command": data(p.command, MAX_COMMAND),
              "gpu_memory_mib": p.gpu_memory_mib} for p in ps[:MAX_PROCESSES]]
    return {"processes": shown, "more_processes": max(0, len(ps) - MAX_PROCESSES)}


def gpu_doc(host: str, g: GpuInfo, ann: Annotation, offered: bool, now: datetime, me: str,
            shares: tuple[Reservation, ...] = ()) -> dict[str, Any]:
    """One GPU; its ``state``: free (offered to you now), queued (idle and unreserved but
    kept for a waiter), busy, reserved (someone else's), mine, shared (memory shares),
    lost."""
    r, flags, insts = ann
    state = ("lost" if g.lost else "shared" if shares
             else "mine" if r is not None and r.user == me
             else "reserved" if r is not None else "free" if offered
             else "queued" if is_free(g) else "busy")
    doc: dict[str, Any] = {
        "gpu": f"{host}:{g.index}", "index": g.index, "state": state,
        "name": data(g.name, 80), "uuid": data(g.uuid, 80),
        "load_percent": g.utilization_percent, "memory_used_mib": g.memory_used_mib,
        "memory_total_mib": g.memory_total_mib, "memory_free_mib": g.memory_free_mib,
        "temperature_c": g.temperature_c, "power_w": g.power_draw_w,
        "reservation": reservation_doc(r, now, me) if r else None, "flags": flags,
    } | processes_doc(g.processes)
    if shares:
        doc["shares"] = [reservation_doc(s, now, me) for s in shares]
        doc["unshared_mib"] = unshared_mib(g, shares)
    if g.lost:
        doc["lost_reason"] = data(g.lost_reason)
    if g.instances:
        doc["instances"] = [instance_doc(host, g, i, ir, iflags, now, me)
                            for i, (ir, iflags) in zip(g.instances, insts)]
    return doc


def instance_doc(host: str, g: GpuInfo, i: MigInstance, r: Reservation | None,
                 flags: list[str], now: datetime, me: str) -> dict[str, Any]:
    return {"gpu": f"{host}:{g.index}/{i.gpu_instance_id}", "profile": data(i.profile, 40),
            "uuid": data(i.uuid, 80), "memory_used_mib": i.memory_used_mib,
            "memory_total_mib": i.memory_total_mib,
            "reservation": reservation_doc(r, now, me) if r else None,
            "flags": flags} | processes_doc(i.processes)


def host_error(h: HostSnapshot) -> dict[str, Any] | None:
    if h.error is None:
        return None
    return {"kind": h.error.kind, "message": data(h.error.message)}


def found_doc(f: FreeGpu, yours: Reservation | None) -> dict[str, Any]:
    """A GPU (or MIG instance) ``find_gpus`` offers; ``yours``: your reservation of it."""
    doc: dict[str, Any] = {
        "gpu": f.label, "host": f.host, "index": f.gpu.index, "name": data(f.gpu.name, 80),
        "uuid": data(f.gpu.uuid, 80), "memory_free_mib": f.free_mib,
        "memory_total_mib": (f.instance or f.gpu).memory_total_mib,
        "load_percent": f.gpu.utilization_percent,
        "yours_until": iso(yours.expires) if yours else None}
    if f.instance is not None:
        doc |= {"instance": f.instance.gpu_instance_id,
                "profile": data(f.instance.profile, 40), "mig_uuid": data(f.instance.uuid, 80)}
    return doc


def fit_doc(f: ShareFit, share_mib: int) -> dict[str, Any]:
    """A GPU a share fits on (best fit first: one already shared before an untouched one)."""
    return {"gpu": f.label, "host": f.host, "index": f.gpu.index,
            "name": data(f.gpu.name, 80), "uuid": data(f.gpu.uuid, 80),
            "share_mib": share_mib, "unshared_mib": f.room_mib, "shared": bool(f.shares),
            "memory_free_mib": f.gpu.memory_free_mib,
            "memory_total_mib": f.gpu.memory_total_mib}
