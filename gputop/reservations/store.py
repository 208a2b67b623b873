"""The shared reservations file: never lost, never corrupt, always current.

Writers take an exclusive POSIX lock on a separate, permanent lock file (``filelock``: it
stays a lock when that file is removed or replaced), and a ``flock`` on a second one (the
lock a writer over SSH takes on the file's host, :mod:`gputop.reservations.remote`),
re-read the file under the lock, write a temp file in the same directory, fsync it,
``os.replace`` it over the old one and fsync the directory. Readers need no lock: they see
the old file or the new one, whole. A ``kill -9`` at any instant leaves one of the two. A
file that does not validate is reported and left byte-for-byte untouched; nothing here
ever "repairs" it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import secrets
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Protocol

from gputop.model import iso, utcnow
from gputop.reservations.filelock import (
    FILE_MODE,
    SshWritersLock,
    WriterLock,
    make_group_writable,
    os_message,
)
from gputop.reservations.filelock import StoreError as StoreError  # (re-exported)
from gputop.reservations.filelock import nfs_lock_problem as nfs_lock_problem
from gputop.text import clean

#: Version 2 adds the wait queue and job-tied reservations; version 3 memory shares of a
#: GPU (``share_mib``: several reservations of one GPU). Rule: gputop reads versions 1-3
#: and writes the lowest one that holds what the file uses: version 1 while it uses none
#: of these (so an older gputop on the team keeps working until someone queues, runs a job
#: or takes a share), else 2, else 3 (an older gputop then refuses the file with "upgrade
#: gputop" and leaves it untouched: a gputop that knows nothing of shares would read two
#: shares of one GPU as a broken file, or a share as a whole reservation).
FILE_VERSION = 3
READ_VERSIONS = (1, 2, 3)
#: The version a file with shares needs.
SHARES_VERSION = 3
#: The largest share (MiB): 1 PiB, far beyond any GPU; a bigger number is hostile.
MAX_SHARE_MIB = 2**30
MAX_WAITERS = 1_000
MAX_FILE_BYTES = 4 * 1024 * 1024
MAX_NOTE = 500
MAX_RESERVATIONS = 10_000
#: The audit trail's bound, per kind: force-releases, skip-queues and queue removals each
#: keep their own last MAX_EVENTS, apart from routine events (``job-ended``, a waiter
#: removing its own place), so that cheap actions repeated in a loop can never push out
#: the record of a forced one.
MAX_EVENTS = 200
KEPT_APART = ("force-release", "skip-queue", "queue-remove")
MAX_INSTANCE = 255  # MIG GPU instance ids are small (0-14 on an H100)
LOCK_TIMEOUT = 15.0
#: Reservations are bounded when read by the reader's max_duration, but never by less than
#: this (the default max_duration): a teammate whose config allows less must not cut short,
#: or prune on a write, what the team's rule allowed someone else.
MIN_BOUND_S = 7 * 86400.0
#: The longest lease a queue waiter may hold (it renews every half lease).
MAX_LEASE_S = 300.0
#: A lapsed waiter stays in the file (counting for nobody) this long before a write drops
#: it, so that one whose renewal waited out another writer's lock can still take its place
#: back (see ``Queue.renew``).
LAPSED_KEEP_S = 60.0


#: Limits on every string in the file: long enough for any real name, short enough that a
#: hostile file cannot make records huge.
MAX_NAME = 256
MAX_GPU_INDEX = 65_535
#: Times outside these years are refused: local-time display and arithmetic stay in range.
MIN_YEAR, MAX_YEAR = 1970, 9000
_INT_DIGITS = 20  # a JSON integer longer than this is refused before int() sees it


#: Names (user, host, machine, id, uuid): what real user names, host names and GPU uuids are
#: made of. Anything else (control or zero-width characters, spaces) could make one user's
#: reservation look like another's on every screen, so such a file is refused as hostile.
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.@+:$\\-]+")


def _text(value: Any, where: str, *, limit: int = MAX_NAME, empty: bool = False,
          name: bool = True) -> str:
    """A string field: right type, bounded, encodable (no lone surrogates); a name holds
    only name characters, free text (a note) nothing that cleaning would change."""
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string, not {_jtype(value)}")
    if len(value) > limit:
        raise ValueError(f"{where}: longer than {limit} characters")
    if not value and not empty:
        raise ValueError(f"{where}: empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where}: contains an unpaired surrogate") from None
    if name and value and not _NAME_CHARS.fullmatch(value):
        raise ValueError(f"{where}: not a name ({value[:40]!r})")
    if not name and clean(value) != value:
        raise ValueError(f"{where}: contains control or escape characters")
    return value


def _jtype(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(v), "a value")


def parse_time(value: Any, where: str) -> datetime:
    value = _text(value, where, limit=64)
    try:
        t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{where}: not an ISO time: {value[:40]!r}") from None
    if t.tzinfo is None:
        raise ValueError(f"{where}: time without a timezone")
    try:
        t = t.astimezone(timezone.utc)
    except OverflowError:
        raise ValueError(f"{where}: time out of range: {value[:40]!r}") from None
    if not MIN_YEAR <= t.year <= MAX_YEAR:
        raise ValueError(f"{where}: time out of range ({MIN_YEAR}-{MAX_YEAR}): {value[:40]!r}")
    return t


def _int(value: Any, where: str, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where}: expected an integer, not {_jtype(value)}")
    if not lo <= value <= hi:
        raise ValueError(f"{where}: out of range ({lo}-{hi})")
    return value


MAX_PID = 2**31 - 1


@dataclass(frozen=True)
class Job:
    """The work a reservation belongs to, on the reservation's host: ``pid`` (``None`` while
    ``gputop run`` is still starting it), whether it names a whole session (``run``: every
    process of the remote session) or one process (``reserve --until-exit``), when that pid
    started (as the host tells it: a later process that gets the same pid is not the job),
    and since when a checker has seen it gone (the release waits a grace period after
    that)."""

    pid: int | None
    session: bool = False
    gone_since: datetime | None = None
    start: datetime | None = None
    #: While ``pid`` is None: the ``gputop run`` process starting the job, on the
    #: reservation's ``machine`` (its pid and start time). Once it is gone and the pid was
    #: never recorded, the job is released after the grace (see ``gputop.jobs.reap``).
    runner: int | None = None
    runner_start: datetime | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "pid": self.pid, "session": self.session,
            "gone_since": None if self.gone_since is None else iso(self.gone_since)}
        if self.start is not None:
            d["start"] = iso(self.start)
        if self.runner is not None:
            d["runner"] = self.runner
            if self.runner_start is not None:
                d["runner_start"] = iso(self.runner_start)
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Job:
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected an object, not {_jtype(d)}")
        if set(d) - {"start", "runner", "runner_start"} != {"pid", "session", "gone_since"}:
            raise ValueError(f"{where}: expected the fields gone_since, pid, session "
                             "(and start, runner, runner_start)")
        pid = None if d["pid"] is None else _int(d["pid"], f"{where}.pid", 1, MAX_PID)
        if not isinstance(d["session"], bool):
            raise ValueError(f"{where}.session: expected a boolean, not {_jtype(d['session'])}")
        gone = d["gone_since"]
        start = d.get("start")
        runner = d.get("runner")
        rstart = d.get("runner_start")
        return cls(pid, d["session"],
                   None if gone is None else parse_time(gone, f"{where}.gone_since"),
                   None if start is None else parse_time(start, f"{where}.start"),
                   None if runner is None else _int(runner, f"{where}.runner", 1, MAX_PID),
                   None if rstart is None else parse_time(rstart, f"{where}.runner_start"))


@dataclass(frozen=True)
class Reservation:
    id: str
    host: str
    gpu: int
    user: str
    machine: str
    created: datetime
    expires: datetime
    uuid: str | None = None
    note: str = ""
    #: Set for a reservation that ends with its job (``run``, ``reserve --until-exit``).
    job: Job | None = None
    #: A MIG GPU instance id: the reservation covers that instance only. None: the whole
    #: GPU, which covers all of its instances.
    instance: int | None = None
    #: A memory share of the GPU (MiB): several people may hold shares of one GPU until
    #: its memory is committed (``gputop.reservations.shares``). None: the whole GPU.
    share_mib: int | None = None
    #: The account the holder's gputop logs in as on ``host`` (its SSH user; the local user
    #: for a ``local`` host), where it is not ``user``: a process of either is the holder's.
    #: Written only when it differs, so files without it stay readable by older gputops.
    login: str | None = None
    #: Not in the file: its expiry was further ahead than ``max_duration`` when read, so
    #: ``expires`` here is created + max_duration (see ``StoreState.active``).
    beyond_max: bool = field(default=False, compare=False)

    def is_holder(self, user: str | None) -> bool:
        """Whether ``user`` (a process owner on the host, or a local user) is the holder:
        the name the reservation was made under or the account it logs in as there."""
        return user is not None and (user == self.user or user == self.login)

    def active(self, now: datetime) -> bool:
        return self.expires > now

    @property
    def is_share(self) -> bool:
        return self.share_mib is not None

    @property
    def target(self) -> str:
        """``host:gpu`` or ``host:gpu/instance`` (not cleaned: callers clean for display)."""
        return f"{self.host}:{self.gpu}" + ("" if self.instance is None else f"/{self.instance}")

    def covers(self, host: str, gpu: int, instance: int | None) -> bool:
        """Whether this reservation and one of ``host:gpu[/instance]`` overlap: the same
        GPU, and either of them whole or both the same instance."""
        return (self.host == host and self.gpu == gpu
                and (self.instance is None or instance is None or self.instance == instance))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["created"], d["expires"] = iso(self.created), iso(self.expires)
        if self.job is None:
            del d["job"]  # a version-1 record stays exactly what version 1 wrote
        else:
            d["job"] = self.job.to_dict()
        if self.instance is None:  # files without instances stay readable by older gputops
            del d["instance"]
        if self.share_mib is None:  # (the same for shares)
            del d["share_mib"]
        if self.login is None or self.login == self.user:
            del d["login"]
        del d["beyond_max"]
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Reservation:
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected an object, not {_jtype(d)}")
        extra = set(d) - {"id", "host", "gpu", "user", "machine", "created", "expires", "uuid",
                          "note", "job", "instance", "share_mib", "login"}
        if extra:
            raise ValueError(f"{where}: unknown field {sorted(extra)[0][:40]!r}")
        gpu = d.get("gpu")
        if not isinstance(gpu, int) or isinstance(gpu, bool):
            raise ValueError(f"{where}.gpu: expected an integer, not {_jtype(gpu)}")
        if not 0 <= gpu <= MAX_GPU_INDEX:
            raise ValueError(f"{where}.gpu: out of range (0-{MAX_GPU_INDEX})")
        inst = d.get("instance")
        if inst is not None and (not isinstance(inst, int) or isinstance(inst, bool)):
            raise ValueError(f"{where}.instance: expected an integer, not {_jtype(inst)}")
        if inst is not None and not 0 <= inst <= MAX_INSTANCE:
            raise ValueError(f"{where}.instance: out of range (0-{MAX_INSTANCE})")
        if inst is not None and "share_mib" in d:
            raise ValueError(f"{where}: a share of a MIG instance (MIG GPUs are shared by "
                             "their instances)")
        share = d.get("share_mib")
        uuid = d.get("uuid")
        login = d.get("login")
        return cls(instance=inst,
                   share_mib=None if "share_mib" not in d else _int(
                       share, f"{where}.share_mib", 1, MAX_SHARE_MIB),
                   login=None if login is None else _text(login, f"{where}.login"),
                   id=_text(d.get("id"), f"{where}.id"), host=_text(d.get("host"), f"{where}.host"),
                   gpu=gpu, user=_text(d.get("user"), f"{where}.user"),
                   machine=_text(d.get("machine"), f"{where}.machine", empty=True),
                   created=parse_time(d.get("created"), f"{where}.created"),
                   expires=parse_time(d.get("expires"), f"{where}.expires"),
                   uuid=None if uuid is None else _text(uuid, f"{where}.uuid"),
                   note=_text(d.get("note", ""), f"{where}.note", limit=MAX_NOTE, empty=True,
                              name=False),
                   job=None if d.get("job") is None else Job.from_dict(d["job"], f"{where}.job"))


@dataclass(frozen=True)
class Waiter:
    """One place in the wait queue: who waits for what, since when, and until when their
    lease holds (a waiter renews it while it runs; a dead one drops out when it ends)."""

    id: str
    user: str
    machine: str
    count: int
    created: datetime
    lease: datetime
    min_free_mib: int = 0
    #: The hosts it accepts (from ``--host``/``--tag``); empty: any host.
    hosts: tuple[str, ...] = ()
    #: What it asked for, as typed (``--tag a100``), for people.
    want: str = ""
    #: All GPUs on one host (``gputop run``: one job runs on one host).
    one_host: bool = False
    #: Waits for a memory share of this size (version 3), not for whole GPUs.
    share_mib: int = 0
    #: The hosts it can be granted on as its own gputop sees them now (they answer it and
    #: could meet the request), renewed with the lease; others give way only for GPUs on
    #: these. None: not recorded (an older gputop's waiter; judged by the reader's hosts).
    sees: tuple[str, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {"id": self.id, "user": self.user, "machine": self.machine, "count": self.count,
             "created": iso(self.created), "lease": iso(self.lease),
             "min_free_mib": self.min_free_mib, "hosts": list(self.hosts), "want": self.want,
             "one_host": self.one_host}
        if self.share_mib:  # a file without share waiters stays readable by older gputops
            d["share_mib"] = self.share_mib
        if self.sees is not None:
            d["sees"] = list(self.sees)
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Waiter:
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected an object, not {_jtype(d)}")
        keys = {"id", "user", "machine", "count", "created", "lease", "min_free_mib", "hosts",
                "want", "one_host"}
        if set(d) - {"share_mib", "sees"} != keys:
            raise ValueError(f"{where}: expected the fields {', '.join(sorted(keys))} "
                             "(and share_mib, sees)")
        sees = d.get("sees")
        if sees is not None and (not isinstance(sees, list) or len(sees) > 1000):
            raise ValueError(f"{where}.sees: expected an array of at most 1000 host names")
        hosts = d["hosts"]
        if not isinstance(d["one_host"], bool):
            raise ValueError(f"{where}.one_host: expected a boolean")
        if not isinstance(hosts, list) or len(hosts) > 1000:
            raise ValueError(f"{where}.hosts: expected an array of at most 1000 host names")
        return cls(id=_text(d["id"], f"{where}.id"), user=_text(d["user"], f"{where}.user"),
                   machine=_text(d["machine"], f"{where}.machine", empty=True),
                   count=_int(d["count"], f"{where}.count", 1, MAX_GPU_INDEX),
                   created=parse_time(d["created"], f"{where}.created"),
                   lease=parse_time(d["lease"], f"{where}.lease"),
                   min_free_mib=_int(d["min_free_mib"], f"{where}.min_free_mib", 0, 2**40),
                   hosts=tuple(_text(h, f"{where}.hosts[{i}]") for i, h in enumerate(hosts)),
                   want=_text(d["want"], f"{where}.want", limit=MAX_NOTE, empty=True,
                              name=False),
                   one_host=d["one_host"],
                   share_mib=_int(d["share_mib"], f"{where}.share_mib", 1, MAX_SHARE_MIB)
                   if "share_mib" in d else 0,
                   sees=None if sees is None else tuple(
                       _text(h, f"{where}.sees[{i}]") for i, h in enumerate(sees)))


_EVENT_KEYS = {"time", "action", "by", "machine", "reservation"}
#: A waiter removed from the queue by a command (version 2): the waiter instead of a
#: reservation.
_WAITER_EVENT_KEYS = {"time", "action", "by", "machine", "waiter"}


def check_event(e: Any, where: str) -> dict[str, Any]:
    """An audit event is written back as it was read, so it is validated as strictly."""
    if not isinstance(e, dict):
        raise ValueError(f"{where}: expected an object, not {_jtype(e)}")
    if set(e) not in (_EVENT_KEYS, _WAITER_EVENT_KEYS):
        raise ValueError(f"{where}: expected the fields {', '.join(sorted(_EVENT_KEYS))}"
                         " (or waiter instead of reservation)")
    parse_time(e["time"], f"{where}.time")
    for k in ("action", "by"):
        _text(e[k], f"{where}.{k}")
    _text(e["machine"], f"{where}.machine", empty=True)
    if "waiter" in e:
        Waiter.from_dict(e["waiter"], f"{where}.waiter")
    else:
        Reservation.from_dict(e["reservation"], f"{where}.reservation")
    return e


@dataclass(frozen=True)
class StoreState:
    reservations: tuple[Reservation, ...] = ()
    #: Audit trail of forced releases (bounded): who released whose reservation, when.
    events: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    #: The wait queue, first come first served (version 2).
    queue: tuple[Waiter, ...] = ()
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
        doc: dict[str, Any] = {"version": SHARES_VERSION if shares else 2 if new else 1,
                               "reservations": [r.to_dict() for r in self.reservations],
                               "events": list(self.events)}
        if new:
            doc["queue"] = [w.to_dict() for w in self.queue]
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
        {"queue"} if version >= 2 else set())
    if extra:  # writing back would drop it: refuse instead of losing it
        raise _untouched(path, f"unknown top-level field {sorted(extra)[0][:40]!r}")
    items = doc.get("reservations")
    events = doc.get("events", [])
    queue = doc.get("queue", [])
    if not isinstance(items, list) or not isinstance(events, list) or not isinstance(queue,
                                                                                     list):
        raise _untouched(path, "'reservations', 'events' and 'queue' must be arrays")
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
    except ValueError as exc:
        raise _untouched(path, f"invalid record {exc}") from None
    return StoreState(rs, evs, ws)


def encode(state: StoreState, path: Path) -> bytes:
    """The file's bytes, refused (StoreError) if gputop would refuse to read them back."""
    n = len(state.reservations)
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


def settle(new: StoreState, now: datetime) -> StoreState:
    """What every write prunes: ended reservations, old events, long-lapsed waiters."""
    return replace(new, reservations=tuple(r for r in new.reservations
                                           if new.ends(r, now) > now),
                   events=bounded_events(new.events),
                   queue=tuple(w for w in new.queue if kept(w, now)))


def local_identity() -> tuple[str, str]:
    """(user, machine) of this process: the user from the real uid, never ``$USER``."""
    uid = os.getuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:  # a uid without a passwd entry (containers): still a stable identity
        user = f"uid{uid}"
    return user, socket.gethostname()


class ReservationStore(Protocol):
    """What every user of the shared file needs, wherever the file is: :class:`Store` (a
    path here) and :class:`gputop.reservations.remote.RemoteStore` (``HOST:/path``)."""

    remote: bool

    @property
    def label(self) -> str: ...

    def read(self) -> StoreState: ...

    def update(self, change: Callable[[StoreState, datetime], StoreState], *,
               timeout: float | None = None) -> StoreState: ...

    def whoami(self) -> tuple[str, str]: ...

    def signature(self) -> Any: ...

    def close(self) -> None: ...


class Store:
    """The file on a path of this machine (a local disk or an NFS mount)."""

    #: Whether a read costs a round trip to another host (see RemoteStore).
    remote = False

    def __init__(self, path: Path, *, warn: Callable[[str], None] | None = None,
                 max_s: float | None = None) -> None:
        self.path = Path(path)
        #: The reader's max_duration (at least MIN_BOUND_S): expiries further ahead are
        #: bounded when read.
        self.max_s = None if max_s is None else max(max_s, MIN_BOUND_S)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._lock = WriterLock(self.lock_path)
        self.flock_path = self.path.with_name(self.path.name + ".flock")
        self._flock = SshWritersLock(self.flock_path)
        self._warn = warn or (lambda m: print(f"gputop: warning: {m}", file=sys.stderr))
        self._nfs_checked = False

    @property
    def label(self) -> str:
        """The file as people name it in messages."""
        return str(self.path)

    def whoami(self) -> tuple[str, str]:
        """Who "me" is for this store: the account running gputop here."""
        return local_identity()

    def signature(self) -> tuple[int, int, int] | None:
        """Changes whenever the file is replaced (no read, no lock): inode, mtime, size."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def close(self) -> None:
        """Nothing held between calls (a RemoteStore's connection is)."""

    # -- reading (no lock) -----------------------------------------------------------------

    def read(self) -> StoreState:
        try:
            # O_NONBLOCK: a FIFO planted at the path must not hang every reader.
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return StoreState(max_s=self.max_s)
        except OSError as exc:
            raise StoreError(os_message(exc, self.path, "read it")) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StoreError(f"{self.path}: not a regular file; gputop reads and "
                                 "writes only a plain file there (it was left untouched)")
            with os.fdopen(fd, "rb", closefd=False) as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise StoreError(os_message(exc, self.path, "read it")) from None
        finally:
            os.close(fd)
        state = decode(raw, self.path, st.st_size)
        return state if self.max_s is None else replace(state, max_s=self.max_s)

    # -- writing (under the lock) ----------------------------------------------------------

    def update(self, change: Callable[[StoreState, datetime], StoreState], *,
               timeout: float | None = None) -> StoreState:
        """Apply ``change`` to the current state under the lock and write it atomically.

        ``change`` may raise to refuse; then nothing is written. Expired reservations are
        pruned on every write. ``timeout``: how long to wait for another writer's lock
        (default LOCK_TIMEOUT; a waiter renewing its lease waits up to the lease's end).
        """
        wait = LOCK_TIMEOUT if timeout is None else timeout
        deadline = time.monotonic() + wait
        while True:
            with self._locked(max(deadline - time.monotonic(), 0.0)) as held:
                state = self.read()
                now = utcnow()
                new = settle(change(state, now), now)
                if new == state:
                    return new
                data = encode(new, self.path)
                # Stalled inside the change (^Z, an NFS stall) while someone removed or
                # replaced the lock file: another writer may have locked the new file and
                # written meanwhile. Start again from the file as it is now.
                if held():
                    self._write(data)
                    return new
            if time.monotonic() > deadline:
                raise StoreError(f"{self.lock_path}: the lock file kept being replaced for "
                                 f"{wait:.3g}s; nothing was changed")

    @contextlib.contextmanager
    def _locked(self, timeout: float) -> Iterator[Callable[[], bool]]:
        """Hold the writers' lock (see ``filelock.WriterLock``); yields whether it is still
        the lock."""
        d = self.path.parent
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(os_message(exc, d, "create it")) from None
        self._check_nfs_once()
        started = time.monotonic()
        with self._lock.held(timeout) as held, \
                self._flock.held(max(timeout - (time.monotonic() - started), 0.0)) as fheld:
            self._remove_stale_temps()
            yield lambda: held() and fheld()

    def _write(self, data: bytes) -> None:
        d = self.path.parent
        tmp = d / f".{self.path.name}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
        except OSError as exc:
            raise StoreError(os_message(exc, d, "write a file in it")) from None
        try:
            try:
                make_group_writable(fd)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StoreError(os_message(exc, self.path, "write it")) from None
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _remove_stale_temps(self) -> None:
        """Temp files exist only while their writer holds the lock; we hold it now, so any
        left over belong to a writer that was killed."""
        prefix = f".{self.path.name}.tmp."
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.path.parent):
                if entry.name.startswith(prefix) and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)

    def _check_nfs_once(self) -> None:
        if self._nfs_checked:
            return
        self._nfs_checked = True
        problem = nfs_lock_problem(self.path.parent)
        if problem:
            self._warn(problem)

def new_reservation(host: str, gpu: int, user: str, machine: str, now: datetime,
                    seconds: float, uuid: str | None, note: str,
                    instance: int | None = None, share_mib: int | None = None) -> Reservation:
    return Reservation(id=secrets.token_hex(6), host=host, gpu=gpu, user=user, machine=machine,
                       created=now, expires=now + timedelta(seconds=seconds), uuid=uuid,
                       note=note, instance=instance, share_mib=share_mib)
