"""The shared reservations file: never lost, never corrupt, always current.

Writers take an exclusive POSIX lock on a separate, permanent lock file (and a ``flock``
on a second one, ``NAME.flock``: the lock a writer over SSH takes with flock(1) on the
file's host, see :mod:`gputop.reservations.remote`), re-read the file under the lock,
write a temp file in the same directory, fsync it, ``os.replace`` it over the old one
and fsync the directory. Readers need no lock: they see the old file or the new one,
whole. A ``kill -9`` at any instant leaves one of the two. A file that does not validate is
reported and left byte-for-byte untouched; nothing here ever "repairs" it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pwd
import re
import secrets
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Protocol

from gputop.model import iso, utcnow
from gputop.text import clean

#: Version 2 adds the wait queue and job-tied reservations. Rule: gputop reads versions 1
#: and 2; it writes version 1 whenever the file uses neither (so an older gputop on the
#: team keeps working until someone queues or runs a job), version 2 otherwise (an older
#: gputop then refuses the file with "upgrade gputop" and leaves it untouched).
FILE_VERSION = 2
READ_VERSIONS = (1, 2)
MAX_WAITERS = 1_000
MAX_FILE_BYTES = 4 * 1024 * 1024
MAX_NOTE = 500
MAX_RESERVATIONS = 10_000
MAX_EVENTS = 200
MAX_INSTANCE = 255  # MIG GPU instance ids are small (0-14 on an H100)
LOCK_TIMEOUT = 15.0
#: The longest lease a queue waiter may hold (it renews every half lease).
MAX_LEASE_S = 300.0
#: A lapsed waiter stays in the file (counting for nobody) this long before a write drops
#: it, so that one whose renewal waited out another writer's lock can still take its place
#: back (see ``Queue.renew``).
LAPSED_KEEP_S = 60.0
FILE_MODE = 0o664  # group-writable: the team shares the file (a setgid dir sets the group)


class StoreError(Exception):
    """The store cannot be used as it is: bad file, permissions, lock. Exit code 2."""


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

    def to_dict(self) -> dict[str, Any]:
        d = {"pid": self.pid, "session": self.session,
             "gone_since": None if self.gone_since is None else iso(self.gone_since)}
        if self.start is not None:
            d["start"] = iso(self.start)
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Job:
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected an object, not {_jtype(d)}")
        if set(d) - {"start"} != {"pid", "session", "gone_since"}:
            raise ValueError(f"{where}: expected the fields gone_since, pid, session "
                             "(and start)")
        pid = None if d["pid"] is None else _int(d["pid"], f"{where}.pid", 1, MAX_PID)
        if not isinstance(d["session"], bool):
            raise ValueError(f"{where}.session: expected a boolean, not {_jtype(d['session'])}")
        gone = d["gone_since"]
        start = d.get("start")
        return cls(pid, d["session"],
                   None if gone is None else parse_time(gone, f"{where}.gone_since"),
                   None if start is None else parse_time(start, f"{where}.start"))


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

    def active(self, now: datetime) -> bool:
        return self.expires > now

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
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Reservation:
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected an object, not {_jtype(d)}")
        extra = set(d) - {"id", "host", "gpu", "user", "machine", "created", "expires", "uuid",
                          "note", "job", "instance"}
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
        uuid = d.get("uuid")
        return cls(instance=inst,
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

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "user": self.user, "machine": self.machine, "count": self.count,
                "created": iso(self.created), "lease": iso(self.lease),
                "min_free_mib": self.min_free_mib, "hosts": list(self.hosts), "want": self.want,
                "one_host": self.one_host}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Waiter:
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected an object, not {_jtype(d)}")
        keys = {"id", "user", "machine", "count", "created", "lease", "min_free_mib", "hosts",
                "want", "one_host"}
        if set(d) != keys:
            raise ValueError(f"{where}: expected the fields {', '.join(sorted(keys))}")
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
                   one_host=d["one_host"])


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

    def active(self, now: datetime | None = None) -> list[Reservation]:
        now = now or utcnow()
        return [r for r in self.reservations if r.active(now)]

    def holder(self, host: str, gpu: int, now: datetime | None = None,
               instance: int | None = None) -> Reservation | None:
        """The reservation of exactly this GPU (``instance`` None) or this instance."""
        return next((r for r in self.active(now) if r.host == host and r.gpu == gpu
                     and r.instance == instance), None)

    def overlapping(self, host: str, gpu: int, instance: int | None,
                    now: datetime | None = None) -> list[Reservation]:
        """Every reservation that overlaps ``host:gpu[/instance]`` (see Reservation.covers)."""
        return [r for r in self.active(now) if r.covers(host, gpu, instance)]

    def waiting(self, now: datetime | None = None) -> list[Waiter]:
        """Waiters whose lease runs. A lease further ahead than MAX_LEASE_S was never
        written by a live waiter (they renew every half lease): it is not honoured, so a
        waiter killed with a lease of years cannot hold the queue's head."""
        now = now or utcnow()
        latest = now + timedelta(seconds=MAX_LEASE_S)
        return [w for w in self.queue if now < w.lease <= latest]

    def to_json(self) -> str:
        new = (bool(self.queue) or any(r.job is not None for r in self.reservations)
               or any("waiter" in e or "job" in e["reservation"] for e in self.events))
        doc: dict[str, Any] = {"version": FILE_VERSION if new else 1,
                               "reservations": [r.to_dict() for r in self.reservations],
                               "events": list(self.events)}
        if new:
            doc["queue"] = [w.to_dict() for w in self.queue]
        return json.dumps(doc, indent=1, ensure_ascii=True) + "\n"


def check_consistent(rs: tuple[Reservation, ...]) -> None:
    """One record per id and per GPU: otherwise "release by id" and "who holds it" are
    ambiguous, and a release could take away someone else's reservation."""
    ids: set[str] = set()
    gpus: dict[tuple[str, int, int | None], int] = {}
    for i, r in enumerate(rs):
        if r.id in ids:
            raise ValueError(f"reservations[{i}].id: duplicate id {r.id[:40]!r}")
        ids.add(r.id)
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


def settle(new: StoreState, now: datetime) -> StoreState:
    """What every write prunes: expired reservations, old events, long-lapsed waiters."""
    return replace(new, reservations=tuple(r for r in new.reservations if r.active(now)),
                   events=new.events[-MAX_EVENTS:],
                   queue=tuple(w for w in new.queue
                               if w.lease > now - timedelta(seconds=LAPSED_KEEP_S)))


_THREAD_LOCKS: dict[str, threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


def local_identity() -> tuple[str, str]:
    """(user, machine) of this process: the user from the real uid, never ``$USER``."""
    uid = os.getuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:  # a uid without a passwd entry (containers): still a stable identity
        user = f"uid{uid}"
    return user, socket.gethostname()


class Store:
    """The file on a path of this machine (a local disk or an NFS mount)."""

    #: Whether a read costs a round trip to another host (see RemoteStore).
    remote = False

    def __init__(self, path: Path, *, warn: Callable[[str], None] | None = None) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        #: flock(2)'d as well: what a remote writer's flock(1) on this host excludes (POSIX
        #: record locks and flocks do not see each other on a local filesystem). A second
        #: file: on NFS a flock is a record lock, and one process's flock and lockf on the
        #: same file would refuse each other.
        self.flock_path = self.path.with_name(self.path.name + ".flock")
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
            return StoreState()
        except OSError as exc:
            raise StoreError(self._os_message(exc, self.path, "read it")) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StoreError(f"{self.path}: not a regular file; gputop reads and "
                                 "writes only a plain file there (it was left untouched)")
            with os.fdopen(fd, "rb", closefd=False) as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise StoreError(self._os_message(exc, self.path, "read it")) from None
        finally:
            os.close(fd)
        return decode(raw, self.path, st.st_size)

    # -- writing (under the lock) ----------------------------------------------------------

    def update(self, change: Callable[[StoreState, datetime], StoreState], *,
               timeout: float | None = None) -> StoreState:
        """Apply ``change`` to the current state under the lock and write it atomically.

        ``change`` may raise to refuse; then nothing is written. Expired reservations are
        pruned on every write. ``timeout``: how long to wait for another writer's lock
        (default LOCK_TIMEOUT; a waiter renewing its lease waits up to the lease's end).
        """
        with self._locked(LOCK_TIMEOUT if timeout is None else timeout):
            state = self.read()
            now = utcnow()
            new = settle(change(state, now), now)
            if new != state:
                self._write(encode(new, self.path))
            return new

    @contextlib.contextmanager
    def _locked(self, timeout: float) -> Iterator[None]:
        d = self.path.parent
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(self._os_message(exc, d, "create it")) from None
        self._check_nfs_once()
        # POSIX record locks belong to the process, not the thread: two threads of one
        # gputop (a waiter's lease keeper and its grant) would both "hold" the file lock.
        # One thread lock per lock file serialises them first.
        with _THREAD_LOCKS_GUARD:
            tlock = _THREAD_LOCKS.setdefault(str(self.lock_path), threading.Lock())
        if not tlock.acquire(timeout=max(timeout, 0.001)):
            raise StoreError(f"{self.lock_path}: still locked by another writer "
                             f"after {timeout:.3g}s")
        try:
            with self._file_locked(timeout):
                yield
        finally:
            tlock.release()

    @contextlib.contextmanager
    def _file_locked(self, timeout: float) -> Iterator[None]:
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
        except OSError as exc:
            raise StoreError(self._os_message(exc, self.lock_path, "open it")) from None
        try:
            self._make_group_writable(fd)
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno == errno.ENOLCK:
                        raise StoreError(
                            f"{self.lock_path}: the filesystem refuses locks (ENOLCK); "
                            "concurrent writers could lose updates. Mount with locking "
                            "enabled (no 'nolock') or use another path.") from None
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise StoreError(self._os_message(exc, self.lock_path, "lock it")) from None
                    if time.monotonic() > deadline:
                        raise StoreError(f"{self.lock_path}: still locked by another writer "
                                         f"after {timeout:.3g}s") from None
                    time.sleep(0.005)
            with self._flocked(deadline):
                self._remove_stale_temps()
                yield
        finally:
            os.close(fd)  # releases the lock

    @contextlib.contextmanager
    def _flocked(self, deadline: float) -> Iterator[None]:
        """The flock(2) that writers over SSH take with flock(1) on this file's host. It
        counts only on the file still at the lock path once locked (one removed and made
        again meanwhile would let two writers each "hold" a lock): else it is taken again."""
        while True:
            try:
                fd = os.open(self.flock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW,
                             FILE_MODE)
            except OSError as exc:
                raise StoreError(self._os_message(exc, self.flock_path, "open it")) from None
            try:
                self._make_group_writable(fd)
                self._flock(fd, deadline)
                try:
                    same = os.stat(self.flock_path, follow_symlinks=False).st_ino == \
                        os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    yield
                    return
            finally:
                os.close(fd)  # releases the flock

    def _flock(self, fd: int, deadline: float) -> None:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise StoreError(self._os_message(exc, self.flock_path,
                                                      "lock it")) from None
                if time.monotonic() > deadline:
                    raise StoreError(f"{self.flock_path}: still locked by another "
                                     "writer (over SSH?)") from None
                time.sleep(0.005)

    def _write(self, data: bytes) -> None:
        d = self.path.parent
        tmp = d / f".{self.path.name}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
        except OSError as exc:
            raise StoreError(self._os_message(exc, d, "write a file in it")) from None
        try:
            try:
                self._make_group_writable(fd)
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
            raise StoreError(self._os_message(exc, self.path, "write it")) from None
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

    @staticmethod
    def _make_group_writable(fd: int) -> None:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            # A hard link planted at our path would make us chmod someone's own file.
            return
        if st.st_uid == os.geteuid() and (st.st_mode & 0o060) != 0o060:
            with contextlib.suppress(OSError):
                os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o060)

    def _check_nfs_once(self) -> None:
        if self._nfs_checked:
            return
        self._nfs_checked = True
        problem = nfs_lock_problem(self.path.parent)
        if problem:
            self._warn(problem)

    @staticmethod
    def _os_message(exc: OSError, path: Path, what: str) -> str:
        if exc.errno in (errno.EACCES, errno.EPERM):
            return (f"{path}: permission denied trying to {what}. Ask the owner to make it "
                    "group-writable (chmod g+w) for your team's group, or set "
                    "[reservations] path to a place you can write.")
        if exc.errno == errno.ELOOP:
            return f"{path}: is a symbolic link; gputop does not follow links for its files"
        if exc.errno == errno.EROFS:
            return f"{path}: read-only filesystem; set [reservations] path elsewhere"
        return f"{path}: cannot {what}: {exc.strerror}"


def nfs_lock_problem(directory: Path, mounts: str = "/proc/mounts") -> str | None:
    """A loud warning if ``directory`` is on an NFS mount whose locks are local-only."""
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    target = str(directory.resolve())
    best: tuple[int, str, str] | None = None
    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and (
                best is None or len(mnt) > best[0]):
            best = (len(mnt), parts[2], parts[3])
    if best is None or not best[1].startswith("nfs"):
        return None
    opts = best[2].split(",")
    if "nolock" in opts or "local_lock=all" in opts or "local_lock=posix" in opts:
        return (f"{directory} is on an NFS mount with local-only locking ({best[2]}): "
                "writers on different machines can overwrite each other's reservations. "
                "Remount without 'nolock'/'local_lock', or keep the file elsewhere.")
    return None


def new_reservation(host: str, gpu: int, user: str, machine: str, now: datetime,
                    seconds: float, uuid: str | None, note: str,
                    instance: int | None = None) -> Reservation:
    return Reservation(id=secrets.token_hex(6), host=host, gpu=gpu, user=user, machine=machine,
                       created=now, expires=now + timedelta(seconds=seconds), uuid=uuid,
                       note=note, instance=instance)
