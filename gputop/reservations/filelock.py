"""The shared file's writers' locks and what its filesystem says: a POSIX record lock and a
flock, each on a separate, permanent lock file (a thread lock per file before the record
lock: POSIX locks belong to the process), which stay locks when their files are removed or
replaced (the locked file must be the one at the lock path, checked after locking and again
before a write lands); permission, link and NFS messages that say what to do.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from gputop.errors import GputopError

FILE_MODE = 0o664  # group-writable: the team shares the file (a setgid dir sets the group)


class StoreError(GputopError):
    """The store cannot be used as it is: bad file, permissions, lock. Exit code 2."""

    reason = "store"


_THREAD_LOCKS: dict[str, threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


class WriterLock:
    """The writers' lock at ``path``: a POSIX record lock on ``reservations.json.lock``, or
    with ``flock`` the ``flock(2)`` on ``reservations.json.flock`` that a writer over SSH
    takes with ``flock(1)`` on the file's host (:mod:`gputop.reservations.remote`). A local
    writer takes both, the record lock first: POSIX record locks and flocks do not see each
    other on a local filesystem. Two files: on NFS a flock is a record lock, and one
    process's flock and record lock on the same file would refuse each other. Either counts
    only on the file still at its path."""

    def __init__(self, path: Path, *, flock: bool = False) -> None:
        self.lock_path = path
        self.flock = flock

    @contextlib.contextmanager
    def held(self, timeout: float) -> Iterator[Callable[[], bool]]:
        """Hold the lock; yields a check that it is still the lock (the locked file is
        still the one at the lock path)."""
        if self.flock:
            # A flock belongs to its open file: two threads' opens exclude each other.
            with self._file_locked(timeout) as held:
                yield held
            return
        # POSIX record locks belong to the process, not the thread: two threads of one
        # gputop (a waiter's lease keeper and its grant) would both "hold" the file lock.
        # One thread lock per lock file serialises them first.
        with _THREAD_LOCKS_GUARD:
            tlock = _THREAD_LOCKS.setdefault(str(self.lock_path), threading.Lock())
        if not tlock.acquire(timeout=max(timeout, 0.001)):
            raise StoreError(self._busy(timeout))
        try:
            with self._file_locked(timeout) as held:
                yield held
        finally:
            tlock.release()

    @contextlib.contextmanager
    def _file_locked(self, timeout: float) -> Iterator[Callable[[], bool]]:
        deadline = time.monotonic() + timeout
        while True:
            fd = self._lock_fd(deadline, timeout)
            if _same_file(self.lock_path, fd):
                break
            # The file we locked was removed (or replaced) meanwhile: a writer that opens
            # the path now locks another file, so this lock excludes nobody. Again.
            os.close(fd)
            if time.monotonic() > deadline:
                raise StoreError(f"{self.lock_path}: the lock file kept being replaced for "
                                 f"{timeout:.3g}s; nothing was changed")
            time.sleep(0.005)
        try:
            yield lambda: _same_file(self.lock_path, fd)
        finally:
            os.close(fd)  # releases the lock

    def _lock_fd(self, deadline: float, timeout: float) -> int:
        """The lock file, open and locked (waiting until ``deadline``)."""
        take = fcntl.flock if self.flock else fcntl.lockf
        fd = open_lock_file(self.lock_path)
        try:
            make_group_writable(fd)
            while True:
                try:
                    take(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return fd
                except OSError as exc:
                    if exc.errno == errno.ENOLCK:
                        raise StoreError(
                            f"{self.lock_path}: the filesystem refuses locks (ENOLCK); "
                            "concurrent writers could lose updates. Mount with locking "
                            "enabled (no 'nolock') or use another path.") from None
                    if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                        raise StoreError(os_message(exc, self.lock_path, "lock it")) from None
                    if time.monotonic() > deadline:
                        raise StoreError(self._busy(timeout)) from None
                    time.sleep(0.005)
        except BaseException:
            os.close(fd)
            raise

    def _busy(self, timeout: float) -> str:
        # Only writers over SSH take the flock alone: a busy flock is most likely theirs.
        who = "another writer (over SSH?)" if self.flock else "another writer"
        return f"{self.lock_path}: still locked by {who} after {timeout:.3g}s"


def open_lock_file(path: Path) -> int:
    """The lock file, open read-write, created if missing; a FIFO, socket or device planted
    at its path is refused at once: looked at first (a device is never opened), and opened
    non-blocking (a FIFO swapped in meanwhile cannot hang the open) then checked again."""
    refuse_special(path, "locks")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_NOCTTY, FILE_MODE)
    except OSError as exc:
        raise StoreError(os_message(exc, path, "open it")) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StoreError(not_a_file(path, "locks"))
    return fd


def refuse_special(path: Path, does: str) -> None:
    """A StoreError if something other than a plain file or a link is at ``path``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return  # missing (or unreadable): the open says what is wrong
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        raise StoreError(not_a_file(path, does))


def not_a_file(path: Path, does: str) -> str:
    return (f"{path}: not a regular file; gputop {does} only a plain file there (it was "
            "left untouched); nothing was written")


def _same_file(path: Path, fd: int) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def make_group_writable(fd: int) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        # A hard link planted at our path would make us chmod someone's own file.
        return
    if st.st_uid == os.geteuid() and (st.st_mode & 0o060) != 0o060:
        with contextlib.suppress(OSError):
            os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o060)


def os_message(exc: OSError, path: Path, what: str) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (f"{path}: permission denied trying to {what}. Ask the owner to make it "
                "group-writable (chmod g+w) for your team's group, or set "
                "[reservations] path to a place you can write.")
    if exc.errno == errno.ELOOP:
        return f"{path}: is a symbolic link; gputop does not follow links for its files"
    if exc.errno == errno.ENXIO:  # a socket (or a device without its driver)
        return not_a_file(path, "uses")
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
