"""The reservations file's content as one value (``StoreState``): what is active, what waits,
how it is read and written as JSON, and the bounds that keep it small.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from gputop.model import utcnow
from gputop.reservations.filelock import StoreError as StoreError  # (re-exported)
from gputop.reservations.filelock import nfs_lock_problem as nfs_lock_problem
from gputop.reservations.records import (
    _INT_DIGITS,
    FILE_VERSION,
    KEPT_APART,
    LAPSED_KEEP_S,
    MAX_EVENTS,
    MAX_FILE_BYTES,
    MAX_LEASE_S,
    MAX_RESERVATIONS,
    MAX_ROUTES,
    MAX_USER_BYTES,
    MAX_USER_ENTRIES,
    MAX_WAITERS,
    READ_VERSIONS,
    ROUTES_VERSION,
    SHARES_VERSION,
    Reservation,
    RouteRecord,
    Waiter,
    _jtype,
    check_event,
)
from gputop.text import clean


@dataclass(frozen=True)
class StoreState:
    reservations: tuple[Reservation, ...] = ()
    #: Audit trail of forced releases (bounded): who released whose reservation, when.
    events: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    #: The wait queue, first come first served (version 2).
    queue: tuple[Waiter, ...] = ()
    #: People's own notification routes (version 4), one per person and kind.
    routes: tuple[RouteRecord, ...] = ()
    #: The reader's ``max_duration``: an expiry further ahead than that is bounded when
    #: read (None: as written). Not in the file.
    max_s: float | None = field(default=None, compare=False)

    def ends(self, r: Reservation, now: datetime | None = None) -> datetime:
        """When ``r`` ends for this reader: its expiry, or, when that is further ahead
        than ``max_duration`` from now, its creation (at the latest now) + max_duration."""
        if self.max_s is None:
            return r.expires
        now = now or utcnow()
        limit = timedelta(seconds=self.max_s)
        if r.expires <= now + limit:
            return r.expires
        return min(r.expires, min(r.created, now) + limit)

    def active(self, now: datetime | None = None) -> list[Reservation]:
        """Unexpired reservations; one whose expiry was beyond ``max_duration`` comes with
        ``expires`` bounded and ``beyond_max`` set (what every reader then goes by)."""
        now = now or utcnow()
        if self.max_s is None:
            return [r for r in self.reservations if r.active(now)]
        out = []
        for r in self.reservations:
            end = self.ends(r, now)
            if end > now:
                out.append(r if end == r.expires else replace(r, expires=end, beyond_max=True))
        return out

    def holder(self, host: str, gpu: int, now: datetime | None = None,
               instance: int | None = None) -> Reservation | None:
        """The reservation of exactly this GPU (``instance`` None) or this instance; never
        a share (a GPU may have several: ``shares.shares_of``)."""
        return next((r for r in self.active(now) if r.host == host and r.gpu == gpu
                     and r.instance == instance and r.share_mib is None), None)

    def overlapping(self, host: str, gpu: int, instance: int | None,
                    now: datetime | None = None) -> list[Reservation]:
        """Every reservation that overlaps ``host:gpu[/instance]`` (see Reservation.covers)."""
        return [r for r in self.active(now) if r.covers(host, gpu, instance)]

    def aliased(self, host: str, uuid: str | None, instance: int | None,
                now: datetime | None = None) -> list[Reservation]:
        """Reservations of the GPU with this ``uuid`` made under another host name (a
        teammate's config may call one machine by another name): the same GPU, so they
        overlap as ``overlapping`` would (a share, a whole GPU, or the same instance)."""
        if not uuid:
            return []
        return [r for r in self.active(now) if r.uuid == uuid and r.host != host
                and (r.instance is None or instance is None or r.instance == instance)]

    def lapsed(self, now: datetime | None = None) -> list[Waiter]:
        """Places still in the file that count for nobody (their lease ended, or lies
        further ahead than any live waiter writes): listed so that they can be removed."""
        now = now or utcnow()
        live = {w.id for w in self.waiting(now)}
        return [w for w in self.queue if w.id not in live]

    def waiting(self, now: datetime | None = None) -> list[Waiter]:
        """Waiters whose lease runs. A lease further ahead than MAX_LEASE_S was never
        written by a live waiter (they renew every half lease): it is not honoured, so a
        waiter killed with a lease of years cannot hold the queue's head."""
        now = now or utcnow()
        latest = now + timedelta(seconds=MAX_LEASE_S)
        return [w for w in self.queue if now < w.lease <= latest]

    def to_json(self) -> str:
        shares = (any(r.share_mib is not None for r in self.reservations)
                  or any(w.share_mib for w in self.queue)
                  or any("share_mib" in e.get("reservation", e.get("waiter", {}))
                         for e in self.events))
        # Fields an older gputop reads as a broken record: version 3 makes it say "upgrade
        # gputop" instead (and leave the file untouched, as it does either way).
        shares = shares or any(r.login is not None for r in self.reservations) or any(
            w.sees is not None for w in self.queue) or any(
            r.job is not None and r.job.runner is not None for r in self.reservations)
        new = (shares or bool(self.queue) or any(r.job is not None for r in self.reservations)
               or any("waiter" in e or "job" in e["reservation"] for e in self.events))
        new = new or bool(self.routes)
        version = (ROUTES_VERSION if self.routes else SHARES_VERSION if shares else 2 if new
                   else 1)
        doc: dict[str, Any] = {"version": version,
                               "reservations": [r.to_dict() for r in self.reservations],
                               "events": list(self.events)}
        if new:
            doc["queue"] = [w.to_dict() for w in self.queue]
        if self.routes:
            doc["routes"] = [r.to_dict() for r in self.routes]
        return json.dumps(doc, indent=1, ensure_ascii=True) + "\n"


def check_consistent(rs: tuple[Reservation, ...]) -> None:
    """One record per id and per GPU (a share: per GPU and holder): otherwise "release by
    id" and "who holds it" are ambiguous, and a release could take away someone else's
    reservation."""
    ids: set[str] = set()
    gpus: dict[tuple[str, int, int | None], int] = {}
    shares: dict[tuple[str, int, str], int] = {}
    for i, r in enumerate(rs):
        if r.id in ids:
            raise ValueError(f"reservations[{i}].id: duplicate id {r.id[:40]!r}")
        ids.add(r.id)
        if r.share_mib is not None:
            j = shares.setdefault((r.host, r.gpu, r.user), i)
            if j != i:
                raise ValueError(f"reservations[{i}]: a second share of {r.host[:40]!r}:"
                                 f"{r.gpu} for {r.user[:40]!r} (reservations[{j}] holds it)")
            continue
        j = gpus.setdefault((r.host, r.gpu, r.instance), i)
        if j != i:
            raise ValueError(f"reservations[{i}]: a second reservation of "
                             f"{r.host[:40]!r}:{r.gpu}"
                             + ("" if r.instance is None else f"/{r.instance}")
                             + f" (reservations[{j}] holds it)")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > _INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _untouched(path: Path, what: str) -> StoreError:
    return StoreError(f"{path}: {what}; the file was left untouched, fix or move it away")


def decode(raw: bytes, path: Path, size: int | None = None) -> StoreState:
    """Validate a whole file; any problem is a StoreError naming the file (and record).

    Valid JSON can still be hostile (nesting, huge numbers, NaN, odd types, surrogates):
    nothing but StoreError or a valid state ever comes out of here.
    """
    size = len(raw) if size is None else size
    if size > MAX_FILE_BYTES or len(raw) > MAX_FILE_BYTES:
        raise StoreError(f"{path}: {max(size, len(raw))} bytes is larger than the "
                         f"{MAX_FILE_BYTES} allowed; refusing to read it (the file was left "
                         "untouched)")
    if not raw.strip():
        return StoreState()
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_no_constant,
                         parse_int=_bounded_int)
    except UnicodeDecodeError as exc:
        raise _untouched(path, f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise _untouched(path, "not valid JSON for gputop (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError and the hooks above
        raise _untouched(path, f"not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(doc, dict):
        raise _untouched(path, f"expected a JSON object, not {_jtype(doc)}")
    version = doc.get("version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise StoreError(f"{path}: unknown version {repr(version)[:40]} (this gputop reads "
                         f"versions 1-{FILE_VERSION}); the file was left untouched: upgrade "
                         "gputop?")
    extra = set(doc) - {"version", "reservations", "events"} - (
        {"queue"} if version >= 2 else set()) - (
        {"routes"} if version >= ROUTES_VERSION else set())
    if extra:  # writing back would drop it: refuse instead of losing it
        raise _untouched(path, f"unknown top-level field {sorted(extra)[0][:40]!r}")
    items = doc.get("reservations")
    events = doc.get("events", [])
    queue = doc.get("queue", [])
    routes = doc.get("routes", [])
    if not (isinstance(items, list) and isinstance(events, list)
            and isinstance(queue, list) and isinstance(routes, list)):
        raise _untouched(path, "'reservations', 'events', 'queue' and 'routes' must be arrays")
    if len(routes) > MAX_ROUTES:
        raise _untouched(path, f"{len(routes)} routes, more than the {MAX_ROUTES} allowed")
    if len(queue) > MAX_WAITERS:
        raise _untouched(path, f"{len(queue)} waiters, more than the {MAX_WAITERS} allowed")
    if len(items) > MAX_RESERVATIONS:
        raise _untouched(path, f"{len(items)} reservations, more than the {MAX_RESERVATIONS} "
                         "allowed")
    try:
        rs = tuple(Reservation.from_dict(d, f"reservations[{i}]") for i, d in enumerate(items))
        if version < 2 and (any(r.job is not None for r in rs) or any(
                isinstance(e, dict) and ("waiter" in e or (
                    isinstance(e.get("reservation"), dict) and "job" in e["reservation"]))
                for e in events)):
            raise ValueError("reservations: 'job' (and a waiter's event) needs version 2")
        check_consistent(rs)
        evs = tuple(check_event(e, f"events[{i}]") for i, e in enumerate(events))
        ws = tuple(Waiter.from_dict(w, f"queue[{i}]") for i, w in enumerate(queue))
        if version < SHARES_VERSION and (
                any(r.share_mib is not None for r in rs) or any(w.share_mib for w in ws)
                or any("share_mib" in e.get("reservation", e.get("waiter", {}))
                       for e in evs)):
            raise ValueError(f"reservations: 'share_mib' needs version {SHARES_VERSION}")
        if len({w.id for w in ws}) != len(ws):
            raise ValueError("queue: duplicate waiter id")
        rts = tuple(RouteRecord.from_dict(r, f"routes[{i}]") for i, r in enumerate(routes))
        if len({(r.user, r.kind) for r in rts}) != len(rts):
            raise ValueError("routes: a second route of one kind for one person")
    except ValueError as exc:
        raise _untouched(path, f"invalid record {exc}") from None
    return StoreState(rs, evs, ws, rts)


def encode(state: StoreState, path: Path) -> bytes:
    """The file's bytes, refused (StoreError) if gputop would refuse to read them back."""
    n = len(state.reservations)
    if len(state.routes) > MAX_ROUTES:
        raise StoreError(f"{path}: refusing to write {len(state.routes)} routes, more than "
                         f"the {MAX_ROUTES} a reader accepts; nothing was changed")
    if len(state.queue) > MAX_WAITERS:
        raise StoreError(f"{path}: refusing to write {len(state.queue)} waiters, more than "
                         f"the {MAX_WAITERS} a reader accepts; nothing was changed")
    if n > MAX_RESERVATIONS:
        raise StoreError(f"{path}: refusing to write {n} reservations, more than the "
                         f"{MAX_RESERVATIONS} a reader accepts; nothing was changed")
    try:
        check_consistent(state.reservations)
    except ValueError as exc:
        raise StoreError(f"{path}: refusing to write an inconsistent file ({exc}); "
                         "nothing was changed") from None
    data = state.to_json().encode()
    if len(data) > MAX_FILE_BYTES:
        raise StoreError(f"{path}: refusing to write {len(data)} bytes, more than the "
                         f"{MAX_FILE_BYTES} a reader accepts (notes with non-ASCII text take "
                         "6-12 bytes a character); nothing was changed: release reservations "
                         "or shorten notes")
    try:  # by construction: never write what a reader would refuse
        decode(data, path)
    except StoreError as exc:
        reason = str(exc).removeprefix(f"{path}: ").split("; the file was left")[0]
        raise StoreError(f"{path}: refusing to write a file gputop could not read back "
                         f"({reason}); nothing was changed") from None
    return data


def event_kind(e: dict[str, Any]) -> str:
    """The bound an event counts toward: its action if kept apart, else routine (""). A
    waiter's own removal of its place (``release --waiter`` without ``--force``) is
    routine: only someone else's place taken out is a forced action, and repeating one's
    own cheap removals must not push that record out."""
    action = e.get("action")
    if action not in KEPT_APART:
        return ""
    waiter = e.get("waiter")
    if action == "queue-remove" and isinstance(waiter, dict) and waiter.get("user") == e.get(
            "by"):
        return ""
    return str(action)


#: An audit event keeps this much of the note (or a waiter's ``want``) it copies: who did
#: what to which GPU, when, is the record; 800 events with a 500-emoji note each (6 KB in
#: the file) would otherwise take most of MAX_FILE_BYTES, and then nobody could write.
EVENT_TEXT = 40


def _short_event(e: dict[str, Any]) -> dict[str, Any]:
    for key, text in (("reservation", "note"), ("waiter", "want")):
        rec = e.get(key)
        if isinstance(rec, dict) and isinstance(rec.get(text), str) and len(
                rec[text]) > EVENT_TEXT:
            return e | {key: rec | {text: rec[text][:EVENT_TEXT - 1] + "\u2026"}}
    return e


def bounded_events(events: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
    """The last MAX_EVENTS of each kind (``event_kind``), in file order, each copied note
    cut to EVENT_TEXT characters."""
    counts: dict[str, int] = {}
    keep: list[dict[str, Any]] = []
    for e in reversed(events):
        kind = event_kind(e)
        n = counts.get(str(kind), 0)
        if n < MAX_EVENTS:
            counts[str(kind)] = n + 1
            keep.append(_short_event(e))
    if len(keep) == len(events) and all(a is b for a, b in zip(reversed(keep), events)):
        return events
    return tuple(reversed(keep))


def kept(w: Waiter, now: datetime) -> bool:
    """Whether a write keeps this waiter: a lapsed one for LAPSED_KEEP_S (its renewal may
    take it back), a lease further ahead than MAX_LEASE_S (never written by a live waiter)
    not at all."""
    return now - timedelta(seconds=LAPSED_KEEP_S) < w.lease <= now + timedelta(
        seconds=MAX_LEASE_S)


class OverBudget(StoreError):
    """A write would take a user past their budget in the file (``MAX_USER_ENTRIES``,
    ``MAX_USER_BYTES``); nothing was written."""


def entry_bytes(record: Reservation | Waiter | RouteRecord) -> int:
    """The bytes a reservation or queue place takes in the file (as ``to_json`` writes
    it: two more spaces a line, and the comma and newline after it)."""
    text = json.dumps(record.to_dict(), indent=1, ensure_ascii=True)
    return len(text) + 2 * (text.count("\n") + 1) + 2


def usage(state: StoreState, user: str) -> tuple[int, int]:
    """``user``'s reservations, queue places and routes in the file, and the bytes they
    take."""
    mine: list[Reservation | Waiter | RouteRecord] = [
        r for r in state.reservations if r.user == user]
    mine += [w for w in state.queue if w.user == user]
    mine += [r for r in state.routes if r.user == user]
    return len(mine), sum(entry_bytes(e) for e in mine)


def check_budgets(before: StoreState, after: StoreState) -> None:
    """Refuse (OverBudget) a write that grows a user's part of the file past their budget.
    Only users whose entries changed are measured; one already past it may still shrink."""
    old_rs, old_ws = set(before.reservations), set(before.queue)
    old_routes = set(before.routes)
    users = {r.user for r in after.reservations if r not in old_rs} | {
        w.user for w in after.queue if w not in old_ws} | {
        r.user for r in after.routes if r not in old_routes}
    for user in sorted(users):
        n, size = usage(after, user)
        if n <= MAX_USER_ENTRIES and size <= MAX_USER_BYTES:
            continue
        n0, size0 = usage(before, user)
        if (n > MAX_USER_ENTRIES and n > n0) or (size > MAX_USER_BYTES and size > size0):
            raise OverBudget(
                f"{clean(user[:64])} would hold {n} reservations and queue places taking {size} "
                f"bytes in the shared file; each user may hold at most {MAX_USER_ENTRIES} "
                f"taking {MAX_USER_BYTES // 1024} kB (now {n0}, {size0} bytes): release "
                "some, or shorten notes; nothing was changed")


class NotYours(StoreError):
    """A write would set, change or remove someone else's route; nothing was written."""


def check_route_owners(before: StoreState, after: StoreState, writer: str) -> None:
    """Refuse (NotYours) a write that touches a route of anyone but ``writer`` (the
    identity the store knows the writer by): nobody redirects or silences another's
    notices."""
    changed = set(before.routes) ^ set(after.routes)
    others = sorted({r.user for r in changed if r.user != writer})
    if others:
        raise NotYours(f"{clean(writer[:64])} may not set or remove the notification routes "
                       f"of {clean(others[0][:64])}: only its owner can; nothing was changed")


def settle(new: StoreState, now: datetime, before: StoreState | None = None) -> StoreState:
    """What every write prunes: ended reservations, old events, long-lapsed waiters.
    ``before``: the file as read; a user's growth past their budget is refused."""
    out = replace(new, reservations=tuple(r for r in new.reservations
                                          if new.ends(r, now) > now),
                  events=bounded_events(new.events),
                  queue=tuple(w for w in new.queue if kept(w, now)))
    if before is not None:
        check_budgets(before, out)
    return out


