"""What reserving and releasing mean: all-or-nothing, refusals that say who and until when.

Used by the CLI commands and by the board alike, so both refuse and extend the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Literal

from gputop.errors import EXIT_REFUSED, GputopError
from gputop.model import iso
from gputop.reservations.records import MAX_NOTE, Reservation
from gputop.reservations.state import StoreState
from gputop.reservations.store import ReservationStore, local_identity
from gputop.reservations.terms import Target as Target
from gputop.reservations.terms import Terms, new_reservation
from gputop.text import clean


class Refused(GputopError):
    """The request conflicts with someone else's reservation or the queue's claim (exit
    code 1). ``reason``: ``conflict``, ``queue`` (a waiter could use it) or ``not-yours``
    (releasing another's without --force)."""

    exit_code = EXIT_REFUSED
    reason = "conflict"

    def __init__(self, message: str, holders: Sequence[Reservation] = (), *,
                 reason: str | None = None) -> None:
        super().__init__(message, reason=reason)
        self.holders = tuple(holders)


class Invalid(GputopError):
    """The request itself is wrong: bad note, duration, host or GPU (exit code 2)."""

    reason = "invalid"


def whoami(store: ReservationStore | None = None) -> tuple[str, str]:
    """(user, machine) recorded in each reservation and used for every "is it mine" check.

    The user comes from the real uid, never from ``$USER``/``$LOGNAME``: anyone can set
    those, and then release a teammate's reservation without ``--force`` or a record. For
    a store over SSH it is the account that the store's host authenticated (a laptop's
    own login name may not exist on the cluster): ``store.whoami()``.
    """
    return local_identity() if store is None else store.whoami()


def local_time(t: datetime) -> str:
    """A time as people read it: local, to the minute, with the zone (JSON keeps UTC)."""
    return t.astimezone().strftime("%Y-%m-%d %H:%M %Z").rstrip()


def describe(r: Reservation, now: datetime) -> str:
    left = max(0, int((r.expires - now).total_seconds()))
    note = f' ("{clean(r.note)}")' if r.note else ""
    if r.share_mib is not None:
        return (f"{clean(r.target)}: a {size_text(r.share_mib)} share of it is held by "
                f"{clean(r.user)} until {local_time(r.expires)} ({format_duration(left)} "
                f"left){note}")
    what = "instance" if r.instance is not None else ""
    return (f"{clean(r.target)} {what + ' ' if what else ''}is reserved by {clean(r.user)} until "
            f"{local_time(r.expires)} ({format_duration(left)} left){note}")


def ends_with(r: Reservation) -> str | None:
    """What a job-tied reservation ends with, or None for one that runs to its time: a
    ``run`` reservation otherwise reads like a plain one of max_duration."""
    job = r.job
    if job is None:
        return None
    host = clean(r.host)
    if job.pid is None:  # gputop run has not recorded its job's pid yet
        return f"ends with its job on {host} (gputop run is starting it)"
    what = "job" if job.session else "process"
    return (f"ends with {what} {job.pid} on {host}"
            + (" (gone: released soon)" if job.gone_since is not None else ""))


def left_text(r: Reservation, now: datetime) -> str:
    """The time a table cell gives a reservation: what is left of it, or ``job`` for one
    that ends with its job (its expiry is only a bound: read as "7d" it looked held for a
    week)."""
    if r.job is not None:
        return "job"
    return format_duration(max(0.0, (r.expires - now).total_seconds()))


def size_text(mib: int) -> str:
    """``30G``, ``19.6G``, ``512M``: sizes as people type them to ``--share``, rounded
    down to a tenth of a GiB (so that a room said is a room that fits: an "80 GB" H100
    holds 81559 MiB, 79.6G), never in e-notation."""
    tenths = mib * 10 // 1024
    if mib < 1024:
        return f"{mib}M"
    return f"{tenths // 10}G" if tenths % 10 == 0 else f"{tenths // 10}.{tenths % 10}G"


def format_duration(seconds: float) -> str:
    """To the nearest minute: a reservation for 2h just made reads "2h00m", not "1h59m"."""
    s = round(seconds / 60) * 60
    if s >= 86400:
        days, hours = s // 86400, (s % 86400) // 3600
        return f"{days}d{hours}h" if hours else f"{days}d"
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
class Outcome:
    """What ``reserve`` did to one GPU: a new reservation, or your own one extended or kept
    (it already lasted longer than asked; ``previous`` is how it was before), or your own
    job's reservation made a plain one for the time asked ("untied")."""

    action: Literal["reserved", "extended", "kept", "untied"]
    reservation: Reservation
    previous: Reservation | None = None


def reserve(store: ReservationStore, targets: Sequence[Target], *, seconds: float,
            max_seconds: float, note: str = "", user: str = "") -> list[Reservation]:
    """Reserve every target or none (see ``reserve_outcomes``)."""
    return [o.reservation for o in reserve_outcomes(
        store, targets, Terms(seconds, max_seconds, note, user=user))]


def check_terms(terms: Terms) -> None:
    """Refuse terms that may not be written: a duration beyond ``max_seconds``, a bad note."""
    if terms.seconds <= 0 or terms.seconds > terms.max_seconds:
        raise Invalid("duration must be between 1 second and "
                      f"{format_duration(terms.max_seconds)}")
    check_note(terms.note)


def signed(store: ReservationStore, terms: Terms) -> Terms:
    """``terms`` with who asks filled in where not given: who this gputop is to ``store``."""
    me, here = whoami(store)
    return replace(terms, user=terms.user or me, machine=terms.machine or here)


def until(terms: Terms, now: datetime) -> datetime:
    try:
        return now + timedelta(seconds=terms.seconds)
    except OverflowError:
        raise Invalid(f"duration too long: {terms.seconds:g} seconds") from None


def reserve_outcomes(store: ReservationStore, targets: Sequence[Target], terms: Terms, *,
                     check: Callable[[StoreState, datetime], Collection[str] | None]
                     | None = None, event: str | None = None) -> list[Outcome]:
    """Reserve every target or none. Your own reservations are extended (note replaced if
    given) or kept when they already last longer; anyone else's unexpired one refuses the
    whole request. ``terms.job`` ties every one of them to that job (``--until-exit``).
    ``check`` may refuse under the lock (the queue's claim); the targets (labels) it
    returns are recorded in the file's audit trail under ``event`` when newly reserved
    (``--skip-queue``: only a GPU that actually skipped someone). ``terms.login(host)``:
    the account this gputop logs in as there, recorded with each new reservation."""
    check_terms(terms)
    if not targets:
        raise Invalid("no GPU given")
    terms = signed(store, terms)
    user, machine, note = terms.user, terms.machine, terms.note
    made: list[Outcome] = []

    def change(state: StoreState, now: datetime) -> StoreState:
        made.clear()
        record = set((check(state, now) or ()) if check is not None else ())
        # A whole-GPU reservation covers its instances, and an instance's blocks its GPU;
        # any share (yours too: a share and a whole reservation exclude each other) blocks
        # the whole GPU.
        conflicts = list({h.id: h for t in targets
                          for h in state.overlapping(t.host, t.gpu, t.instance, now)
                          if h.user != user or h.share_mib is not None}.values())
        # The same GPU under another host name (its uuid): anyone's, yours too.
        conflicts += list({h.id: h for t in targets
                           for h in state.aliased(t.host, t.uuid, t.instance, now)}.values())
        if conflicts:
            raise Refused("; ".join(describe(h, now) for h in conflicts), conflicts)
        end = until(terms, now)
        keep = list(state.reservations)
        ids = {r.id for r in keep}
        said: set[str] = set()
        for t in targets:
            own = state.holder(t.host, t.gpu, now, t.instance)
            job = terms.job_on(t.host)
            if own is None and t.instance is not None:  # your whole GPU covers it
                own = state.holder(t.host, t.gpu, now)
            if own is not None:
                at = next(i for i, r in enumerate(keep) if r.id == own.id)
                if own.id in said:  # two targets on one reservation: said once
                    continue
                said.add(own.id)
                if job is None and own.job is not None:
                    # Asked for by hand: it is now yours for the time asked, no longer
                    # released when the job (a `run`, an --until-exit pid) ends.
                    new = replace(own, expires=end, note=note or own.note,
                                  uuid=t.uuid or own.uuid, job=None)
                    keep[at] = new
                    made.append(Outcome("untied", new, own))
                    continue
                new = replace(own, expires=max(own.expires, end), note=note or own.note,
                              uuid=t.uuid or own.uuid, job=job or own.job)
                keep[at] = new
                made.append(Outcome("extended" if end > own.expires else "kept", new, own))
            else:
                new = new_reservation(t, terms, now, ids)
                keep.append(new)
                made.append(Outcome("reserved", new))
        events = state.events + tuple(
            {"time": iso(now), "action": event, "by": user, "machine": machine,
             "reservation": o.reservation.to_dict()}
            for o in made if event and o.action == "reserved"
            and o.reservation.target in record)
        return replace(state, reservations=tuple(keep), events=events)

    store.update(change)
    return list(made)


def release(store: ReservationStore, targets: Sequence[Target] | None, *, force: bool = False,
            user: str | None = None) -> list[Reservation]:
    """Release the given GPUs (``None``: all of mine). Someone else's needs ``force``, and a
    forced release is recorded with who forced it."""
    me, here = whoami(store)
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
                r = state.holder(t.host, t.gpu, now, t.instance)
                if r is None and t.instance is None:  # the GPU's shares, if it has any:
                    # your own; with --force (none of yours) everyone's, each recorded
                    shares = [s for s in state.active(now) if s.share_mib is not None
                              and (s.host, s.gpu) == (t.host, t.gpu)]
                    mine = [s for s in shares if s.user == user]
                    (gone if mine or force else others).extend(mine or shares)
                    continue
                if r is None:
                    continue
                (gone if r.user == user or force else others).append(r)
            if others:
                raise Refused("; ".join(describe(r, now) for r in others)
                              + " (use --force to release someone else's)", others,
                              reason="not-yours")
        events = list(state.events)
        for r in gone:
            if r.user != user:
                events.append({"time": iso(now), "action": "force-release", "by": user,
                               "machine": here, "reservation": r.to_dict()})
        released.extend(gone)
        # Ids are unique (the store refuses a file where they are not): exactly these go.
        ids = {r.id for r in gone}
        return replace(state, reservations=tuple(r for r in state.reservations
                                                 if r.id not in ids), events=tuple(events))

    store.update(change)
    return list(released)
