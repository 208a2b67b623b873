"""Memory shares of one whole GPU: for notebooks and light jobs, so that an 80 GB GPU a
notebook uses 6 GB of is not held whole.

A share is a reservation with a size (``share_mib``). Several people hold shares of one
GPU until its memory is committed: the shares of a GPU never add up to more than its
total memory (as the live host reports it when the share is taken), a whole-GPU
reservation conflicts with any share of it and a share with a whole (or MIG instance)
reservation, and a GPU in MIG mode takes no shares (its instances are the shares there).
One person holds at most one share of a GPU: asking again resizes and extends it. Every
check runs under the store's lock, on the file as it is then, so concurrent shares by
several people lose nothing and never overcommit a GPU.

Advisory, as every reservation: nothing caps a process's memory but the framework's own
knob (``gputop run --share`` sets the ones an environment variable can set); a holder
whose processes use more than their share is flagged ``over-share``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Literal

from gputop.model import GpuInfo, HostSnapshot, iso
from gputop.reservations.ops import (
    Invalid,
    Refused,
    Target,
    check_terms,
    describe,
    signed,
    size_text,
    until,
)
from gputop.reservations.records import MAX_SHARE_MIB, Reservation
from gputop.reservations.state import StoreState
from gputop.reservations.store import ReservationStore
from gputop.reservations.terms import Terms, new_reservation
from gputop.text import clean

__all__ = ["ShareFit", "ShareOutcome", "best_fit", "check_share", "committed_mib",
           "holder_use_mib", "mig_mode", "parse_size_mib", "reserve_share", "room_mib",
           "share_dict", "share_index", "shares_of"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)


def parse_size_mib(text: str) -> int:
    """``20G``, ``512M``, ``1.5T`` to MiB; a bare number is refused (MiB or GiB?)."""
    m = _SIZE.match(text)
    if not m:
        raise Invalid(f"not a memory size: {text!r} (use e.g. 20G or 512M)")
    if not m.group(2):  # "20" meant as 20 GB would pick a GPU with 20 MiB free
        raise Invalid(f"memory size {text!r} needs a unit: e.g. {text.strip()}G or "
                      f"{text.strip()}M")
    factor = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}[m.group(2).upper()]
    return int(float(m.group(1)) * factor)


def shares_of(state: StoreState | None, host: str, gpu: int, now: datetime
              ) -> list[Reservation]:
    """The active shares of ``host:gpu``, in the file's order (the order they were taken)."""
    if state is None:
        return []
    return [r for r in state.active(now)
            if r.share_mib is not None and r.host == host and r.gpu == gpu]


def share_index(state: StoreState | None, now: datetime
                ) -> dict[tuple[str, int], tuple[Reservation, ...]]:
    """Every shared GPU's active shares by (host, gpu), in the file's order."""
    out: dict[tuple[str, int], list[Reservation]] = {}
    if state is None:
        return {}
    for r in state.active(now):
        if r.share_mib is not None:
            out.setdefault((r.host, r.gpu), []).append(r)
    return {k: tuple(v) for k, v in out.items()}


def committed_mib(shares: Iterable[Reservation], but: str | None = None) -> int:
    """What the shares hold together (``but``: without that user's own share)."""
    return sum(r.share_mib or 0 for r in shares if r.user != but)


def room_mib(total_mib: int, shares: Iterable[Reservation], but: str | None = None) -> int:
    """The GPU's unshared rest: its total less every share (``but``'s own excepted)."""
    return max(0, total_mib - committed_mib(shares, but))


def holder_use_mib(g: GpuInfo, r: Reservation) -> int:
    """What the share's holder's processes on the GPU use now (MiB; unknown counts 0):
    those of the name it was taken under or of the account its holder logs in as there."""
    return sum(p.gpu_memory_mib or 0 for p in g.processes if r.is_holder(p.user))


def mig_mode(g: GpuInfo) -> bool:
    return bool(g.instances) or (g.mig_mode or "").strip().lower() == "enabled"


@dataclass(frozen=True)
class ShareOutcome:
    """What ``reserve_share`` did: a new share, or your own one resized and/or extended
    (``previous`` is how it was), or kept as it was."""

    action: Literal["reserved", "resized", "extended", "kept"]
    reservation: Reservation
    previous: Reservation | None = None


def _whole_holders(state: StoreState, host: str, gpu: int, now: datetime
                   ) -> list[Reservation]:
    return [r for r in state.active(now)
            if r.host == host and r.gpu == gpu and r.share_mib is None]


def check_share(state: StoreState, t: Target, share_mib: int, total_mib: int, user: str,
                now: datetime) -> None:
    """Refuse (``Refused``) a share that does not fit ``t`` now: a whole or instance
    reservation of the GPU (anyone's, yours too), or not enough room left unshared."""
    alias = state.aliased(t.host, t.uuid, None, now)  # this GPU under another host name
    if alias:
        raise Refused("; ".join(describe(r, now) for r in alias), alias)
    whole = _whole_holders(state, t.host, t.gpu, now)
    if whole:
        mine = [r for r in whole if r.user == user]
        raise Refused("; ".join(describe(r, now) for r in whole)
                      + ("; a share and a whole reservation of one GPU exclude each other: "
                         f"release it first (gputop release {clean(t.host)}:{t.gpu})"
                         if mine else ""), whole)
    shares = shares_of(state, t.host, t.gpu, now)
    room = room_mib(total_mib, shares, but=user)
    if share_mib > room:
        others = [r for r in shares if r.user != user]
        held = ", ".join(f"{clean(r.user)} {size_text(r.share_mib or 0)}" for r in others)
        raise Refused(f"{clean(t.host)}:{t.gpu} has {size_text(room)} ({room} MiB) of "
                      f"{size_text(total_mib)} left unshared ({held or 'no shares'}); "
                      f"asked for {size_text(share_mib)}: ask for at most "
                      f"{size_text(room)}, or another GPU (gputop free --share "
                      f"{size_text(share_mib)})", others)


def reserve_share(store: ReservationStore, t: Target, total_mib: int, terms: Terms, *,
                  check: Callable[[StoreState, datetime], Collection[str] | None]
                  | None = None) -> ShareOutcome:
    """Take a share of ``terms.share_mib`` of GPU ``t`` (whose memory is ``total_mib``), or
    resize and extend your own; ``Refused`` if it does not fit (see ``check_share``).
    ``terms.login``: the account this gputop logs in as on ``t``'s host, recorded with the
    share (as with a whole reservation: the holder's processes there are known by either
    name). ``check`` may refuse under the lock (the queue's order rule); what it returns
    (with ``--skip-queue``: the target, when it skipped someone) is recorded as a
    ``skip-queue`` event with the share taken or resized."""
    share_mib = terms.share_mib or 0
    if t.instance is not None:
        raise Invalid(f"{clean(t.label)}: a MIG instance is not shared (the instances are "
                      "the shares of a MIG GPU): reserve the instance itself")
    if not 1 <= share_mib <= MAX_SHARE_MIB:
        raise Invalid(f"--share {share_mib}M: not a size a GPU has")
    if share_mib > total_mib:
        raise Invalid(f"--share {size_text(share_mib)}: {clean(t.label)} has "
                      f"{size_text(total_mib)} in all")
    check_terms(terms)
    terms = signed(store, terms)
    user, machine = terms.user, terms.machine
    # Asked once, before the lock (a login is resolved from the SSH config).
    job, login = terms.job_on(t.host), terms.login_on(t.host)
    terms = replace(terms, job={t.host: job}.get, login={t.host: login}.get)
    made: list[ShareOutcome] = []

    def change(state: StoreState, now: datetime) -> StoreState:
        made.clear()
        skipped = bool(check(state, now)) if check is not None else False
        check_share(state, t, share_mib, total_mib, user, now)
        end = until(terms, now)
        own = next((r for r in shares_of(state, t.host, t.gpu, now) if r.user == user), None)
        if own is None:
            new = new_reservation(t, terms, now, {r.id for r in state.reservations})
            made.append(ShareOutcome("reserved", new))
            return replace(state, reservations=(*state.reservations, new),
                           events=state.events + _skipped(skipped, new, user, machine, now))
        new = replace(own, share_mib=share_mib, expires=max(own.expires, end),
                      note=terms.note or own.note, uuid=t.uuid or own.uuid,
                      job=job if job is not None else own.job, login=login or own.login)
        action: Literal["resized", "extended", "kept"] = (
            "resized" if share_mib != own.share_mib else
            "extended" if end > own.expires else "kept")
        made.append(ShareOutcome(action, new, own))
        grew = (new.share_mib or 0) > (own.share_mib or 0)
        return replace(state, reservations=tuple(new if r.id == own.id else r
                                                 for r in state.reservations),
                       events=state.events + _skipped(skipped and grew, new, user, machine,
                                                      now))

    store.update(change)
    return made[0]


def share_gpu(h: HostSnapshot | None, t: Target) -> GpuInfo:
    """The live GPU a share is taken of: it must have answered, with its memory, whole."""
    if h is None or not h.ok:
        why = f"it did not answer ({h.error.kind})" if h is not None and h.error else \
            "it did not answer"
        raise Refused(f"cannot take a share of {clean(t.label)}: {why}, so its memory "
                      "cannot be checked; try again when it answers")
    g = next(g for g in h.gpus if g.index == t.gpu)
    if mig_mode(g):
        raise Invalid(f"{clean(t.label)} is in MIG mode: its instances are its shares; "
                      f"reserve one (gputop reserve {clean(t.label)}/INSTANCE; gputop free "
                      "lists the free ones)")
    if g.memory_total_mib is None:
        raise Refused(f"cannot take a share of {clean(t.label)}: it does not report its "
                      "memory")
    return g


def _skipped(skipped: bool, r: Reservation, user: str, machine: str, now: datetime
             ) -> tuple[dict[str, object], ...]:
    """The ``skip-queue`` event of a share that skipped someone (none otherwise)."""
    if not skipped:
        return ()
    return ({"time": iso(now), "action": "skip-queue", "by": user, "machine": machine,
             "reservation": r.to_dict()},)


@dataclass(frozen=True)
class ShareFit:
    """A GPU a share of the asked size fits on: already shared (``shares``) or untouched."""

    host: str
    gpu: GpuInfo
    room_mib: int
    shares: tuple[Reservation, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.host}:{self.gpu.index}"


def best_fit(fits: Sequence[ShareFit]) -> list[ShareFit]:
    """Best-fit order: a GPU already shared before an untouched one (whole GPUs stay whole
    for training), and among each the least room left that fits (the tightest fit keeps
    the larger rooms for larger shares); then host and index."""
    return sorted(fits, key=lambda f: (not f.shares, f.room_mib, f.host, f.gpu.index or 0))


def share_dict(r: Reservation, g: GpuInfo | None, now: datetime) -> dict[str, object]:
    """A share in ``--json``: the reservation's fields plus what its holder uses now."""
    return r.to_dict() | {
        "used_mib": None if g is None else holder_use_mib(g, r),
        "seconds_left": max(0, int((r.expires - now).total_seconds())),
        "expires": iso(r.expires)}
