"""The shared reservations file: never lost, never corrupt, always current.

Writers take an exclusive POSIX lock on a separate, permanent lock file, re-read the file
under the lock, write a temp file in the same directory, fsync it, ``os.replace`` it over the
old one and fsync the directory. Readers need no lock: they see the old file or the new one,
whole. A ``kill -9`` at any instant leaves one of the two. A file that does not validate is
reported and left byte-for-byte untouched; nothing here ever "repairs" it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import stat
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from gputop.model import iso, utcnow

FILE_VERSION = 1
MAX_FILE_BYTES = 4 * 1024 * 1024
MAX_NOTE = 500
MAX_RESERVATIONS = 10_000
MAX_EVENTS = 200
LOCK_TIMEOUT = 15.0
FILE_MODE = 0o664  # group-writable: the team shares the file (a setgid dir sets the group)


class StoreError(Exception):
    """The store cannot be used as it is: bad file, permissions, lock. Exit code 2."""


def parse_time(value: Any, where: str) -> datetime:
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a UTC time string")
    try:
        t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{where}: not an ISO time: {value[:40]!r}") from None
    if t.tzinfo is None:
        raise ValueError(f"{where}: time without a timezone")
    return t.astimezone(timezone.utc)


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

    def active(self, now: datetime) -> bool:
        return self.expires > now

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["created"], d["expires"] = iso(self.created), iso(self.expires)
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Reservation:
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected an object")
        for key, typ in (("id", str), ("host", str), ("gpu", int), ("user", str),
                         ("machine", str)):
            v = d.get(key)
            if not isinstance(v, typ) or isinstance(v, bool):
                raise ValueError(f"{where}.{key}: expected {typ.__name__}")
        note = d.get("note", "")
        if not isinstance(note, str):
            raise ValueError(f"{where}.note: expected a string")
        if len(note) > MAX_NOTE:
            raise ValueError(f"{where}.note: longer than {MAX_NOTE} characters")
        uuid = d.get("uuid")
        if uuid is not None and not isinstance(uuid, str):
            raise ValueError(f"{where}.uuid: expected a string or null")
        extra = set(d) - {"id", "host", "gpu", "user", "machine", "created", "expires", "uuid",
                          "note"}
        if extra:
            raise ValueError(f"{where}: unknown field {sorted(extra)[0]!r}")
        return cls(id=d["id"], host=d["host"], gpu=d["gpu"], user=d["user"],
                   machine=d["machine"], created=parse_time(d.get("created"), f"{where}.created"),
                   expires=parse_time(d.get("expires"), f"{where}.expires"), uuid=uuid, note=note)


@dataclass(frozen=True)
class StoreState:
    reservations: tuple[Reservation, ...] = ()
    #: Audit trail of forced releases (bounded): who released whose reservation, when.
    events: tuple[dict[str, Any], ...] = field(default_factory=tuple)

    def active(self, now: datetime | None = None) -> list[Reservation]:
        now = now or utcnow()
        return [r for r in self.reservations if r.active(now)]

    def holder(self, host: str, gpu: int, now: datetime | None = None) -> Reservation | None:
        return next((r for r in self.active(now) if r.host == host and r.gpu == gpu), None)

    def to_json(self) -> str:
        doc = {"version": FILE_VERSION,
               "reservations": [r.to_dict() for r in self.reservations],
               "events": list(self.events)}
        return json.dumps(doc, indent=1, ensure_ascii=True) + "\n"


def decode(raw: bytes, path: Path) -> StoreState:
    """Validate a whole file; any problem is a StoreError naming the file (and record)."""
    if len(raw) > MAX_FILE_BYTES:
        raise StoreError(f"{path}: {len(raw)} bytes is larger than the {MAX_FILE_BYTES} "
                         "allowed; refusing to read it (the file was left untouched)")
    if not raw.strip():
        return StoreState()
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StoreError(f"{path}: not valid JSON ({exc}); the file was left untouched, "
                         "fix or move it away") from None
    if not isinstance(doc, dict):
        raise StoreError(f"{path}: expected a JSON object; the file was left untouched")
    version = doc.get("version")
    if version != FILE_VERSION:
        raise StoreError(f"{path}: unknown version {version!r} (this gputop reads version "
                         f"{FILE_VERSION}); the file was left untouched: upgrade gputop?")
    items = doc.get("reservations")
    events = doc.get("events", [])
    if not isinstance(items, list) or not isinstance(events, list):
        raise StoreError(f"{path}: 'reservations' and 'events' must be arrays; "
                         "the file was left untouched")
    if len(items) > MAX_RESERVATIONS:
        raise StoreError(f"{path}: more than {MAX_RESERVATIONS} reservations; refusing")
    try:
        rs = tuple(Reservation.from_dict(d, f"reservations[{i}]") for i, d in enumerate(items))
    except ValueError as exc:
        raise StoreError(f"{path}: invalid record {exc}; the file was left untouched") from None
    return StoreState(rs, tuple(e for e in events if isinstance(e, dict)))


class Store:
    def __init__(self, path: Path, *, warn: Callable[[str], None] | None = None) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._warn = warn or (lambda m: print(f"gputop: warning: {m}", file=sys.stderr))
        self._nfs_checked = False

    # -- reading (no lock) -----------------------------------------------------------------

    def read(self) -> StoreState:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return StoreState()
        except OSError as exc:
            raise StoreError(self._os_message(exc, self.path, "read")) from None
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
        return decode(raw, self.path)

    # -- writing (under the lock) ----------------------------------------------------------

    def update(self, change: Callable[[StoreState, datetime], StoreState]) -> StoreState:
        """Apply ``change`` to the current state under the lock and write it atomically.

        ``change`` may raise to refuse; then nothing is written. Expired reservations are
        pruned on every write.
        """
        with self._locked():
            state = self.read()
            now = utcnow()
            new = change(state, now)
            new = replace(new, reservations=tuple(r for r in new.reservations if r.active(now)),
                          events=new.events[-MAX_EVENTS:])
            if new != state:
                self._write(new.to_json().encode())
            return new

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        d = self.path.parent
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(self._os_message(exc, d, "create the directory")) from None
        self._check_nfs_once()
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
        except OSError as exc:
            raise StoreError(self._os_message(exc, self.lock_path, "open the lock file")) from None
        try:
            self._make_group_writable(fd)
            deadline = time.monotonic() + LOCK_TIMEOUT
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
                        raise StoreError(self._os_message(exc, self.lock_path, "lock")) from None
                    if time.monotonic() > deadline:
                        raise StoreError(f"{self.lock_path}: still locked by another writer "
                                         f"after {LOCK_TIMEOUT:.0f}s") from None
                    time.sleep(0.005)
            self._remove_stale_temps()
            yield
        finally:
            os.close(fd)  # releases the lock

    def _write(self, data: bytes) -> None:
        d = self.path.parent
        tmp = d / f".{self.path.name}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
        except OSError as exc:
            raise StoreError(self._os_message(exc, d, "write a file in")) from None
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
            raise StoreError(self._os_message(exc, self.path, "write")) from None
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
            return (f"{path}: permission denied trying to {what} it. Ask the owner to make it "
                    "group-writable (chmod g+w) for your team's group, or set "
                    "[reservations] path to a place you can write.")
        if exc.errno == errno.ELOOP:
            return f"{path}: is a symbolic link; gputop does not follow links for its files"
        if exc.errno == errno.EROFS:
            return f"{path}: read-only filesystem; set [reservations] path elsewhere"
        return f"{path}: cannot {what} it: {exc.strerror}"


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
                    seconds: float, uuid: str | None, note: str) -> Reservation:
    return Reservation(id=secrets.token_hex(6), host=host, gpu=gpu, user=user, machine=machine,
                       created=now, expires=now + timedelta(seconds=seconds), uuid=uuid,
                       note=note)
