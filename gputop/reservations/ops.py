"""What reserving and releasing mean: all-or-nothing, refusals that say who and until when.

Used by the CLI commands and by the board alike, so both refuse and extend the same way.
"""

from __future__ import annotations

import getpass
import socket
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from gputop.model import iso
from gputop.reservations.store import (
    MAX_NOTE,
    Reservation,
    Store,
    StoreState,
    new_reservation,
)
from gputop.text import clean


class Refused(Exception):
    """The request conflicts with someone else's reservation (exit code 1)."""

    def __init__(self, message: str, holders: Sequence[Reservation] = ()) -> None:
        super().__init__(message)
        self.holders = tuple(holders)


class Invalid(ValueError):
    """The request itself is wrong: bad note, duration, host or GPU (exit code 2)."""


def whoami() -> tuple[str, str]:
    """(login name, machine) recorded in each reservation."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return user, socket.gethostname()


def describe(r: Reservation, now: datetime) -> str:
    left = max(0, int((r.expires - now).total_seconds()))
    note = f' ("{clean(r.note)}")' if r.note else ""
    return (f"{clean(r.host)}:{r.gpu} is reserved by {clean(r.user)} until {iso(r.expires)} "
            f"({format_duration(left)} left){note}")


def format_duration(seconds: float) -> str:
    s = int(seconds)
    if s >= 86400:
        return f"{s // 86400}d{(s % 86400) // 3600}h"
    if s >= 3600:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 60}m"


def check_note(note: str) -> str:
    if len(note) > MAX_NOTE:
        raise Invalid(f"note is {len(note)} characters; at most {MAX_NOTE} allowed")
    if clean(note) != note:
        raise Invalid("note contains control or escape characters")
    return note


@dataclass(frozen=True)
class Target:
    host: str
    gpu: int
    uuid: str | None = None


def reserve(store: Store, targets: Sequence[Target], *, seconds: float, max_seconds: float,
            note: str = "", user: str | None = None, machine: str | None = None
            ) -> list[Reservation]:
    """Reserve every target or none. Your own reservations are extended (note replaced if
    given); anyone else's unexpired one refuses the whole request."""
    if seconds <= 0 or seconds > max_seconds:
        raise Invalid(f"duration must be between 1 second and {format_duration(max_seconds)}")
    check_note(note)
    if not targets:
        raise Invalid("no GPU given")
    me, here = whoami()
    user, machine = user or me, machine or here
    made: list[Reservation] = []

    def change(state: StoreState, now: datetime) -> StoreState:
        made.clear()
        conflicts = [h for t in targets
                     if (h := state.holder(t.host, t.gpu, now)) is not None and h.user != user]
        if conflicts:
            raise Refused("; ".join(describe(h, now) for h in conflicts), conflicts)
        keep = list(state.reservations)
        for t in targets:
            own = state.holder(t.host, t.gpu, now)
            if own is not None:
                new = replace(own, expires=max(own.expires, now + timedelta(seconds=seconds)),
                              note=note or own.note, uuid=t.uuid or own.uuid)
                keep[keep.index(own)] = new
            else:
                new = new_reservation(t.host, t.gpu, user, machine, now, seconds, t.uuid, note)
                keep.append(new)
            made.append(new)
        return replace(state, reservations=tuple(keep))

    store.update(change)
    return list(made)


def release(store: Store, targets: Sequence[Target] | None, *, force: bool = False,
            user: str | None = None) -> list[Reservation]:
    """Release the given GPUs (``None``: all of mine). Someone else's needs ``force``, and a
    forced release is recorded with who forced it."""
    me, here = whoami()
    user = user or me
    released: list[Reservation] = []

    def change(state: StoreState, now: datetime) -> StoreState:
        released.clear()
        gone: list[Reservation] = []
        if targets is None:
            gone = [r for r in state.active(now) if r.user == user]
        else:
            others: list[Reservation] = []
            for t in targets:
                r = state.holder(t.host, t.gpu, now)
                if r is None:
                    continue
                (gone if r.user == user or force else others).append(r)
            if others:
                raise Refused("; ".join(describe(r, now) for r in others)
                              + " (use --force to release someone else's)", others)
        events = list(state.events)
        for r in gone:
            if r.user != user:
                events.append({"time": iso(now), "action": "force-release", "by": user,
                               "machine": here, "reservation": r.to_dict()})
        released.extend(gone)
        ids = {r.id for r in gone}
        return replace(state, reservations=tuple(r for r in state.reservations
                                                 if r.id not in ids), events=tuple(events))

    store.update(change)
    return list(released)
