"""The records of the shared reservations file: reservations, waiters, jobs and events,
each checked field by field as it is read (every byte of the file is a teammate's).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from gputop.model import iso
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
#: Version 4 adds people's notification routes (``routes``): an older gputop refuses such a
#: file with "upgrade gputop" and leaves it untouched, so nobody's route is ever dropped.
FILE_VERSION = 4
READ_VERSIONS = (1, 2, 3, 4)
#: The version a file with shares needs.
SHARES_VERSION = 3
#: The version a file with routes needs.
ROUTES_VERSION = 4
#: Each person keeps at most one route of each kind; the file at most this many in all.
MAX_ROUTES = 3_000
ROUTE_KINDS = ("email", "ntfy", "webhook")
MAX_ROUTE_TARGET = 512
#: The largest share (MiB): 1 PiB, far beyond any GPU; a bigger number is hostile.
MAX_SHARE_MIB = 2**30
MAX_WAITERS = 1_000
MAX_FILE_BYTES = 4 * 1024 * 1024
MAX_NOTE = 500
MAX_RESERVATIONS = 10_000
#: Each user's budget in the file: reservations and queue places together, and the bytes
#: they take there. One user's flood is refused for that user alone, and 32 users at
#: their full budget still fit in MAX_FILE_BYTES beside the audit trail (docs/security.md).
MAX_USER_ENTRIES = 64
MAX_USER_BYTES = 64 * 1024
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




_EMAIL = re.compile(r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+")
_URL = re.compile(r"https?://[A-Za-z0-9.-]+(?::[0-9]{1,5})?(?:/[A-Za-z0-9._~%!$&'()*+,;=:@/?-]*)?")


def route_target_problem(kind: str, target: str) -> str | None:
    """Why ``target`` is no route of ``kind`` (None: it is one): an address, or an http(s)
    URL without spaces, control characters or credentials, bounded."""
    if kind not in ROUTE_KINDS:
        return f"unknown route kind {kind[:20]!r} (one of {', '.join(ROUTE_KINDS)})"
    if len(target) > MAX_ROUTE_TARGET:
        return f"longer than {MAX_ROUTE_TARGET} characters"
    if kind == "email":
        if len(target) > 254 or not _EMAIL.fullmatch(target):
            return f"not an e-mail address: {target[:60]!r}"
        return None
    if not _URL.fullmatch(target):
        return f"not an http(s) URL: {target[:60]!r}"
    return None


@dataclass(frozen=True)
class RouteRecord:
    """One person's own route for their notices (``gputop notify me``), kept under the
    identity that wrote it: only that person's gputop changes or removes it."""

    user: str
    kind: str
    target: str
    set: datetime

    def to_dict(self) -> dict[str, Any]:
        return {"user": self.user, "kind": self.kind, "target": self.target,
                "set": iso(self.set)}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> RouteRecord:
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected an object, not {_jtype(d)}")
        if set(d) != {"user", "kind", "target", "set"}:
            raise ValueError(f"{where}: expected the fields kind, set, target, user")
        kind = _text(d["kind"], f"{where}.kind", limit=20)
        target = _text(d["target"], f"{where}.target", limit=MAX_ROUTE_TARGET, name=False)
        problem = route_target_problem(kind, target)
        if problem:
            raise ValueError(f"{where}: {problem}")
        return cls(_text(d["user"], f"{where}.user"), kind, target,
                   parse_time(d["set"], f"{where}.set"))
