"""The history database: an embedded SQLite file, WAL, one writer, versioned schema.

Raw samples are one row per host per refresh (its GPUs packed as compact JSON), kept for a
short window. They are rolled up into per-GPU-per-minute and per-GPU-per-user-per-minute
sums (kept 30 days), and those into per-hour and per-day (UTC) sums (kept forever). A
rollup stores the same accounting the report makes from raw samples, so every tier gives
the same totals.

The file is checked before SQLite writes a byte to it: a file that is not a gputop history
database, is corrupt, or comes from a newer gputop is an error naming it, left untouched.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

from gputop.errors import GputopError
from gputop.history.names import OTHER_NAMES

#: Bumped for every schema change; each step has a migration below.
SCHEMA_VERSION = 4
#: PRAGMA application_id: "GPUT". Tells our file apart from any other SQLite database.
APPLICATION_ID = 0x47505554
_MAGIC = b"SQLite format 3\x00"

GPU_METRICS = ("data", "nodata", "busy", "idle", "held_idle", "util_sum", "util_secs")
USER_METRICS = ("used", "reserved", "reserved_idle", "unreserved", "held_idle", "util_sum",
                "util_secs", "shared", "shared_idle")


#: The per-user sums before schema 4 (which added the memory shares' part).
USER_METRICS_V1 = USER_METRICS[:7]
SHARE_METRICS = USER_METRICS[7:]


def _rollup_tables(tier: str) -> list[str]:
    g = ", ".join(f"{m} REAL NOT NULL" for m in GPU_METRICS)
    u = ", ".join(f"{m} REAL NOT NULL" for m in USER_METRICS_V1)
    return [
        f"CREATE TABLE gpu_{tier} (b INTEGER NOT NULL, gpu INTEGER NOT NULL, {g}, "
        "PRIMARY KEY (b, gpu)) WITHOUT ROWID",
        f"CREATE TABLE user_{tier} (b INTEGER NOT NULL, gpu INTEGER NOT NULL, "
        f"user INTEGER NOT NULL, {u}, PRIMARY KEY (b, gpu, user)) WITHOUT ROWID",
    ]


#: MIGRATIONS[v] takes a database at version v-1 to version v.
MIGRATIONS: dict[int, list[str]] = {
    1: [
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID",
        "CREATE TABLE hosts (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE)",
        "CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE)",
        # key: the GPU's uuid, else "index:N"; current: in the host's latest good answer.
        "CREATE TABLE gpus (id INTEGER PRIMARY KEY, host INTEGER NOT NULL, key TEXT NOT NULL, "
        "idx INTEGER, name TEXT, memory_total_mib INTEGER, current INTEGER NOT NULL DEFAULT 0, "
        "UNIQUE (host, key))",
        # t, dt: milliseconds (UTC epoch; the span the sample stands for, ending at t).
        # gpus: JSON [[gpu, util|null, mem|null, [user ids], holder|null, nodata], ...]
        "CREATE TABLE samples (t INTEGER NOT NULL, host INTEGER NOT NULL, dt INTEGER NOT NULL, "
        "ok INTEGER NOT NULL, error TEXT, gpus TEXT NOT NULL, PRIMARY KEY (t, host)) "
        "WITHOUT ROWID",
        *_rollup_tables("minute"),
        *_rollup_tables("hour"),
        *_rollup_tables("day"),
        "INSERT INTO meta VALUES ('minute_done', 0), ('hour_done', 0), ('day_done', 0), "
        "('minute_from', 0)",
    ],
    # 2: a raw sample's GPU entry may carry a 7th item, its MIG instances as parts
    # (``accounting.Entry``). No table changes shape and version-1 rows read as before,
    # but a version-1 gputop would count such a GPU whole: the version refuses it that file.
    # The mark says from when instances were recorded as fractions.
    2: ["INSERT OR IGNORE INTO meta VALUES ('mig_parts_from', "
        "CAST(strftime('%s', 'now') AS INTEGER))"],
    # 3: bounded history (``names``, ``recorder``). No table changes shape, and version-2
    # rows read as before; but a version-2 gputop would count the pseudo GPU of a host
    # down with its GPUs unknown (key "") as one GPU, and read hours dropped after
    # ``keep_hours`` (before 'hour_from') as time with nothing recorded: the version
    # refuses it that file. '(other names)' holds the time of names not kept.
    3: ["INSERT OR IGNORE INTO meta VALUES ('hour_from', 0)",
        f"INSERT OR IGNORE INTO users (name) VALUES ('{OTHER_NAMES}')"],
    # 4: memory shares. A raw sample's GPU entry may carry an 8th item, its shares
    # (``accounting.Entry``), and the per-user sums say which part of reserved (reserved
    # idle) time came from shares. A version-3 gputop would count a shared GPU as nobody's
    # reservation: the version refuses it that file.
    4: [f"ALTER TABLE user_{tier} ADD COLUMN {m} REAL NOT NULL DEFAULT 0"
        for tier in ("minute", "hour", "day") for m in SHARE_METRICS],
}


class HistoryError(GputopError):
    """The history database cannot be used: ``str()`` names the file. Exit code 2."""

    reason = "history"


def check_file(path: Path) -> None:
    """Refuse, without writing, what is not (yet) a gputop history database of ours."""
    if path.is_symlink():  # like the reservations file: gputop follows no links for its files
        raise HistoryError(f"{path}: is a symbolic link; point [history] path at the file "
                           "itself (it was left untouched)")
    try:
        with open(path, "rb") as f:
            head = f.read(100)
    except FileNotFoundError:
        return
    except IsADirectoryError:
        raise HistoryError(f"{path}: is a directory, not a history database") from None
    except OSError as exc:
        raise HistoryError(f"{path}: cannot read: {exc.strerror}") from None
    if not head:
        return  # an empty file is a new database
    if len(head) < 100 or not head.startswith(_MAGIC):
        raise HistoryError(f"{path}: not an SQLite database (corrupt, or another file); "
                           "it was left untouched")
    version = int.from_bytes(head[60:64], "big")
    app = int.from_bytes(head[68:72], "big")
    if app != APPLICATION_ID and not (app == 0 and version == 0):
        raise HistoryError(f"{path}: an SQLite database, but not a gputop history database; "
                           "it was left untouched")
    if version > SCHEMA_VERSION:
        raise HistoryError(f"{path}: written by a newer gputop (history schema {version}; "
                           f"this gputop reads up to {SCHEMA_VERSION}): upgrade gputop, or "
                           "point [history] path elsewhere. It was left untouched")


class HistoryDB:
    """One open database. ``writer=True`` takes the single-writer lock, migrates, uses WAL."""

    def __init__(self, path: Path, *, writer: bool = False) -> None:
        self.path = Path(path)
        self.writer = writer
        self._lock_fd: int | None = None
        check_file(self.path)
        self._sidecars = [self.path.with_name(self.path.name + s) for s in ("-wal", "-shm")]
        self._existed = existed = [p.exists() for p in self._sidecars]
        try:
            if writer:
                self._take_lock()
                self.conn = self._connect(f"file:{quote(str(self.path))}")
                self._migrate()
            else:
                if not self.path.exists():
                    raise HistoryError(f"{self.path}: no history database here yet (start "
                                       "`gputop record`, or set [history] path)")
                # No -wal file: no recorder is running, nothing uncommitted. Read it as
                # immutable then, so that reading creates no file next to it.
                mode = "ro" if existed[0] else "ro&immutable=1"
                self.conn = self._connect(f"file:{quote(str(self.path))}?mode={mode}")
                self._check_version()
        except HistoryError:
            self.abandon()
            raise

    def abandon(self) -> None:
        """Close after finding the file unusable, removing the -wal/-shm files this open
        created: the directory is left as it was."""
        self.close()
        for p, was in zip(self._sidecars, self._existed):
            if not was:
                with contextlib.suppress(OSError):
                    p.unlink()

    def _connect(self, uri: str) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(uri, uri=True, isolation_level=None,
                                   check_same_thread=False)
            conn.execute("PRAGMA busy_timeout = 5000")
        except sqlite3.Error as exc:
            self.close()
            raise HistoryError(f"{self.path}: cannot open: {exc}") from None
        return conn

    def _take_lock(self) -> None:
        lock = self.path.with_name(self.path.name + ".writer-lock")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise HistoryError(f"{lock}: cannot open the writer lock: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise HistoryError(f"{self.path}: another `gputop record` is writing this database "
                               "(one writer per database)") from None
        self._lock_fd = fd

    def _check_version(self) -> None:
        with self.errors():
            version = self.conn.execute("PRAGMA user_version").fetchone()[0]
            app = self.conn.execute("PRAGMA application_id").fetchone()[0]
        if version == 0 or app != APPLICATION_ID:
            raise HistoryError(f"{self.path}: not a gputop history database (nothing recorded "
                               "yet?)")
        if version > SCHEMA_VERSION:
            check_file(self.path)

    def _migrate(self) -> None:
        with self.errors():
            version = self.conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:  # raced with a newer writer since check_file
                check_file(self.path)
            if version == 0 and self.conn.execute(
                    "SELECT COUNT(*) FROM sqlite_master").fetchone()[0]:
                raise HistoryError(f"{self.path}: an SQLite database, but not a gputop "
                                   "history database; it was left untouched")
            for v in range(version + 1, SCHEMA_VERSION + 1):
                self.conn.execute("BEGIN IMMEDIATE")
                for stmt in MIGRATIONS[v]:
                    self.conn.execute(stmt)
                self.conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                self.conn.execute(f"PRAGMA user_version = {v}")
                self.conn.execute("COMMIT")
            self.conn.execute("PRAGMA journal_mode = WAL")
            self.conn.execute("PRAGMA synchronous = NORMAL")

    @contextlib.contextmanager
    def errors(self) -> Iterator[None]:
        """SQLite's errors (corruption, disk full, lock) as HistoryError naming the file."""
        try:
            yield
        except sqlite3.DatabaseError as exc:
            raise HistoryError(f"{self.path}: unusable history database ({exc}); "
                               "it was left as it is") from None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self.errors():
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.conn
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")

    def user_columns(self) -> list[str]:
        """The per-user sums as a SELECT list: a database from before schema 4 (read, not
        migrated) has no shares' columns, which read as 0 then."""
        with self.errors():
            version = self.conn.execute("PRAGMA user_version").fetchone()[0]
        if version >= 4:
            return list(USER_METRICS)
        return [*USER_METRICS_V1, *(f"0.0 AS {m}" for m in SHARE_METRICS)]

    def meta(self, key: str) -> int:
        with self.errors():
            row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        conn = getattr(self, "conn", None)
        if conn is not None:
            with contextlib.suppress(sqlite3.Error):
                conn.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> HistoryDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
