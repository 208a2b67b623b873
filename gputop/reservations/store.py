"""The shared reservations file: never lost, never corrupt, always current.

Writers take an exclusive POSIX lock on a separate, permanent lock file (``filelock``: it
stays a lock when that file is removed or replaced), and a ``flock`` on a second one (the
lock a writer over SSH takes on the file's host, :mod:`gputop.reservations.remote`),
re-read the file under the lock, write a new file in a private directory of the
writer's made inside the file's own, fsync it, rename it from there over the old one and
fsync the directory (no name in the shared directory is trusted: see ``Store._write``).
Readers need no lock: they see the old file or the new one, whole. A ``kill -9`` at any
instant leaves one of the two. A file that does not validate is reported and left
byte-for-byte untouched; nothing here ever "repairs" it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from gputop.model import utcnow
from gputop.reservations.filelock import (
    FILE_MODE,
    WriterLock,
    make_group_writable,
    os_message,
)
from gputop.reservations.filelock import StoreError as StoreError  # (re-exported)
from gputop.reservations.filelock import nfs_lock_problem as nfs_lock_problem

# The records and the state live in their own modules; importers of the store get them here.
from gputop.reservations.records import (
    FILE_VERSION as FILE_VERSION,
)
from gputop.reservations.records import (
    KEPT_APART as KEPT_APART,
)
from gputop.reservations.records import (
    LAPSED_KEEP_S as LAPSED_KEEP_S,
)
from gputop.reservations.records import (
    LOCK_TIMEOUT as LOCK_TIMEOUT,
)
from gputop.reservations.records import (
    MAX_EVENTS as MAX_EVENTS,
)
from gputop.reservations.records import (
    MAX_FILE_BYTES as MAX_FILE_BYTES,
)
from gputop.reservations.records import (
    MAX_GPU_INDEX as MAX_GPU_INDEX,
)
from gputop.reservations.records import (
    MAX_INSTANCE as MAX_INSTANCE,
)
from gputop.reservations.records import (
    MAX_LEASE_S as MAX_LEASE_S,
)
from gputop.reservations.records import (
    MAX_NAME as MAX_NAME,
)
from gputop.reservations.records import (
    MAX_NOTE as MAX_NOTE,
)
from gputop.reservations.records import (
    MAX_PID as MAX_PID,
)
from gputop.reservations.records import (
    MAX_RESERVATIONS as MAX_RESERVATIONS,
)
from gputop.reservations.records import (
    MAX_SHARE_MIB as MAX_SHARE_MIB,
)
from gputop.reservations.records import (
    MAX_WAITERS as MAX_WAITERS,
)
from gputop.reservations.records import (
    MIN_BOUND_S as MIN_BOUND_S,
)
from gputop.reservations.records import (
    READ_VERSIONS as READ_VERSIONS,
)
from gputop.reservations.records import (
    SHARES_VERSION as SHARES_VERSION,
)
from gputop.reservations.records import (
    Job as Job,
)
from gputop.reservations.records import (
    Reservation as Reservation,
)
from gputop.reservations.records import (
    Waiter as Waiter,
)
from gputop.reservations.records import (
    check_event as check_event,
)
from gputop.reservations.records import (
    parse_time as parse_time,
)
from gputop.reservations.state import (
    EVENT_TEXT as EVENT_TEXT,
)
from gputop.reservations.state import (
    StoreState as StoreState,
)
from gputop.reservations.state import (
    bounded_events as bounded_events,
)
from gputop.reservations.state import (
    check_consistent as check_consistent,
)
from gputop.reservations.state import (
    check_route_owners as check_route_owners,
)
from gputop.reservations.state import (
    decode as decode,
)
from gputop.reservations.state import (
    encode as encode,
)
from gputop.reservations.state import (
    event_kind as event_kind,
)
from gputop.reservations.state import (
    kept as kept,
)
from gputop.reservations.state import (
    settle as settle,
)


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
        self._flock = WriterLock(self.flock_path, flock=True)
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
                new = settle(change(state, now), now, state)
                if new.routes != state.routes:
                    check_route_owners(state, new, self.whoami()[0])
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
        """Write ``data`` to a new file in a fresh private directory of ours (0700, inside
        the shared one: one filesystem) and rename it from there over the file. Everyone in
        the team can rename names in the shared directory, so no name there is trusted:
        the directory is held by an fd (a teammate who renames it moves nothing that we
        then use), and only we can change names inside it."""
        d = self.path.parent
        try:
            dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise StoreError(os_message(exc, d, "open it")) from None
        try:
            private = f".{self.path.name}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
            try:
                os.mkdir(private, 0o700, dir_fd=dfd)
            except OSError as exc:
                raise StoreError(os_message(exc, d, "write a file in it")) from None
            try:
                self._write_from(dfd, private, data)
            finally:
                with contextlib.suppress(OSError):
                    os.rmdir(private, dir_fd=dfd)  # (only ever an empty directory)
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _write_from(self, dfd: int, private: str, data: bytes) -> None:
        try:
            pfd = os.open(private, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
        except OSError:
            raise StoreError(_moved(self.path.parent)) from None
        try:
            fd = os.open(TEMP_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                         FILE_MODE, dir_fd=pfd)
        except OSError as exc:
            os.close(pfd)
            raise StoreError(os_message(exc, self.path.parent, "write a file in it")) from None
        try:
            try:
                if not _private(pfd, fd):
                    raise StoreError(_moved(self.path.parent))
                make_group_writable(fd)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(TEMP_NAME, self.path.name, src_dir_fd=pfd, dst_dir_fd=dfd)
        except OSError as exc:
            raise StoreError(os_message(exc, self.path, "write it")) from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(TEMP_NAME, dir_fd=pfd)
            os.close(pfd)

    def _remove_stale_temps(self) -> None:
        """Temp files exist only while their writer holds the lock; we hold it now, so any
        left over belong to a writer that was killed. Another user's private directory
        cannot be emptied by us: it waits for its owner's next write."""
        prefix = f".{self.path.name}.tmp."
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.path.parent):
                if not entry.name.startswith(prefix):
                    continue
                with contextlib.suppress(OSError):
                    if entry.is_dir(follow_symlinks=False):
                        _remove_private(self.path.parent, entry.name)
                    else:
                        os.unlink(entry.path)  # a file from an older gputop: never followed

    def _check_nfs_once(self) -> None:
        if self._nfs_checked:
            return
        self._nfs_checked = True
        problem = nfs_lock_problem(self.path.parent)
        if problem:
            self._warn(problem)

#: The new file's name inside a writer's private directory.
TEMP_NAME = "gputop-new-file"


def _private(pfd: int, fd: int) -> bool:
    """Whether the directory ``pfd`` is one only we can change names in: ours (the same
    owner as the file we just made in it, which holds under NFS root squashing too) and
    writable by nobody else."""
    dst, fst = os.fstat(pfd), os.fstat(fd)
    return dst.st_uid == fst.st_uid and not dst.st_mode & 0o022


def _moved(d: Path) -> str:
    return (f"{d}: gputop's private directory for the new file was replaced while it "
            "wrote (someone renaming names in the shared directory?); nothing was written")


def _remove_private(d: Path, name: str) -> None:
    """A killed writer's private directory, if it is ours: its one file by that name only
    (never recursive: a directory of ours renamed here by someone keeps what it holds)."""
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        pfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
        try:
            st = os.fstat(pfd)
            if st.st_uid == os.geteuid() and not st.st_mode & 0o022:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(TEMP_NAME, dir_fd=pfd)
        finally:
            os.close(pfd)
        os.rmdir(name, dir_fd=dfd)
    finally:
        os.close(dfd)


def new_reservation(host: str, gpu: int, user: str, machine: str, now: datetime,
                    seconds: float, uuid: str | None, note: str,
                    instance: int | None = None, share_mib: int | None = None) -> Reservation:
    return Reservation(id=secrets.token_hex(6), host=host, gpu=gpu, user=user, machine=machine,
                       created=now, expires=now + timedelta(seconds=seconds), uuid=uuid,
                       note=note, instance=instance, share_mib=share_mib)
