"""The shared reservations file on another host (``HOST:/path``), read and written over SSH.

A laptop does not mount the cluster's NFS; it reaches the file through one kept SSH
connection to ``HOST`` instead, with the local store's guarantees:

- **Writers** run a script (:mod:`gputop.reservations.remote_scripts`, ``WRITER_SCRIPT``)
  on a channel of their own: it takes ``flock -x`` on
  ``PATH.flock`` (util-linux ``flock(1)``: the one tool the host needs beyond a POSIX shell;
  without it a write is a clear error and reads still work), re-reads the file under the
  lock and sends it; gputop decides and sends the new bytes; the script writes them to a
  temp file in the same directory, checks their size, syncs, and renames it over the file.
  The lock's only holder is that shell, blocked on the channel's stdin while gputop
  decides: a client killed (``kill -9``), a dropped connection or a refused change ends
  the channel, the shell reads EOF and exits, and the kernel drops the lock. A client that
  falls silent without closing (a laptop lid shut) is ended by the script's own watchdog
  after ``hold`` seconds. Nothing is written before gputop's end marker has arrived, and
  the rename is the only step that changes the file: never a broken file.
- A local :class:`~gputop.reservations.store.Store` on that host takes the same flock
  (besides its POSIX record lock), so writers on the host and writers over SSH exclude
  each other.
- **Reads** ask the kept reader channel (``READER_SCRIPT``) for the file's POSIX
  ``cksum`` (CRC and size) with the one gputop last saw: an unchanged file costs one short
  line each way, and only a changed one is sent.
- **Identity**: "me" is the account ``HOST`` authenticated (``id -un``, asked once when
  the reader channel starts), never the laptop's login name.

Every byte from the host is hostile: the file's bytes are framed by markers that carry a
fresh nonce per request (sent on the channel, never in a command line), sizes are bounded
while reading, and the content is validated by :func:`~gputop.reservations.store.decode`.
Nothing from the config reaches a command line: the path travels on the channel's stdin.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import os
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import asyncssh

from gputop.model import utcnow
from gputop.reservations.remote_scripts import ERRORS, MARK, READER_SCRIPT, WRITER_SCRIPT
from gputop.reservations.store import (
    LOCK_TIMEOUT,
    MAX_FILE_BYTES,
    MIN_BOUND_S,
    StoreError,
    StoreState,
    check_route_owners,
    decode,
    encode,
    settle,
)

T = TypeVar("T")

#: Lines before our first marker (a shell startup file's banner) and marker lines are
#: bounded: anything longer is not our script talking.
MAX_LINE = 64 * 1024
#: The writer's watchdog: the lock is never held longer than this after the file was sent
#: without gputop answering (a client gone silent without closing its connection).
MIN_HOLD_S = 30
#: A connection that failed is not tried again for this long (the board reads every
#: interval: a host that is down must not cost a connect timeout each time).
RETRY_S = 3.0


class ConnectFailed(Exception):
    """The connector could not reach the host; the message says why (classified)."""


class _Closed(Exception):
    """The channel ended before the answer was complete."""


class _Framing(Exception):
    """An answer that is not what the script prints: the channel is not read again."""


class _Channel:
    """One exec channel's stdout read as marker lines and nonce-framed blocks, bounded."""

    def __init__(self, proc: asyncssh.SSHClientProcess[bytes]) -> None:
        self.proc = proc
        self._buf = bytearray()

    async def _more(self) -> None:
        data = await self.proc.stdout.read(65536)
        if not data:
            raise _Closed("the channel ended")
        self._buf += data

    def write(self, data: bytes) -> None:
        self.proc.stdin.write(data)

    async def line(self) -> str:
        while True:
            i = self._buf.find(b"\n")
            if i >= 0:
                raw = bytes(self._buf[:i])
                del self._buf[:i + 1]
                return raw.decode("utf-8", "replace")
            if len(self._buf) > MAX_LINE:
                raise _Framing("a line longer than any the script prints")
            await self._more()

    async def marker(self, nonce: str, *, banner: bool = False) -> list[str]:
        """The words after ``MARK NONCE`` of the next marker line (``banner``: lines before
        it are a shell startup file's, skipped up to MAX_LINE bytes in all)."""
        prefix = f"{MARK} {nonce} "
        skipped = 0
        while True:
            line = await self.line()
            if line.startswith(prefix):
                words = line[len(prefix):].split(" ")
                if all(re.fullmatch(r"[A-Za-z0-9_.@+:$\\-]{1,256}", w) for w in words):
                    return words
                raise _Framing("a marker line with odd words")
            skipped += len(line) + 1
            if not banner or skipped > MAX_LINE:
                raise _Framing("output that is not the store script's")

    async def block(self, nonce: str, limit: int) -> bytes:
        """The bytes up to the line ``MARK NONCE end`` (the file: at most ``limit``)."""
        end = f"\n{MARK} {nonce} end\n".encode()
        start = 0
        while True:
            i = self._buf.find(end, start)
            if i >= 0:
                data = bytes(self._buf[:i])
                del self._buf[:i + len(end)]
                return data
            if len(self._buf) > limit + len(end):
                raise _Framing(f"more than the {limit} bytes announced")
            start = max(0, len(self._buf) - len(end) + 1)
            await self._more()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.close()


class _Loop:
    """A private event loop on a daemon thread: the store's API is synchronous (every
    caller, threads and event loops alike, calls ``read``/``update`` as on a local file),
    and its SSH connection lives here between calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="gputop-remote-store")
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class RemoteStore:
    """The reservations file at ``host:path``, over one kept SSH connection (see the module).

    ``connect`` opens that connection (host keys verified, ``~/.ssh/config`` honoured: the
    poller's transport) and raises :class:`ConnectFailed` with a classified reason.
    """

    remote = True

    def __init__(self, host: str, path: PurePosixPath | str,
                 connect: Callable[[], Awaitable[asyncssh.SSHClientConnection]], *,
                 timeout: float = 10.0, warn: Callable[[str], None] | None = None,
                 max_s: float | None = None) -> None:
        self.host = host
        self.path = PurePosixPath(path)
        #: The reader's max_duration (see Store): expiries further ahead are bounded.
        self.max_s = None if max_s is None else max(max_s, MIN_BOUND_S)
        self._connect = connect
        self.timeout = timeout
        self._warn = warn or (lambda m: print(f"gputop: warning: {m}", file=sys.stderr))
        #: Messages name the file as the config does: ``HOST:/path``.
        self._named = Path(self.label)
        #: The writer script's watchdog: how long the lock may be held without a word from
        #: gputop (a client frozen or gone silent without closing its connection).
        self.hold_s = max(MIN_HOLD_S, math.ceil(timeout * 3))
        self._runner: _Loop | None = None
        self._runner_guard = threading.Lock()
        self._conn_lock: asyncio.Lock | None = None
        self._pid = -1
        self._conn: asyncssh.SSHClientConnection | None = None
        self._reader: _Channel | None = None
        self._reader_lock: asyncio.Lock | None = None
        self._user: str | None = None
        #: The last answer: the file's (crc, size) and what it held (a broken file's error
        #: too: an unchanged broken file is not fetched again).
        self._cache: tuple[tuple[str, str] | None, StoreState | StoreError] | None = None
        #: Since the host failed: when to try again, and why it failed.
        self._down: tuple[float, str] | None = None
        self._retry: asyncio.Task[None] | None = None
        #: Requests answered, and file bodies fetched, for tests and the benchmark.
        self.requests = 0
        self.fetches = 0

    @property
    def label(self) -> str:
        return f"{self.host}:{self.path}"

    # -- the synchronous API (as Store's) ----------------------------------------------------

    def read(self) -> StoreState:
        """The file's state; fetched only when its checksum changed since the last read."""
        result = self._call(self._read(), self.timeout * 2 + 1)
        if isinstance(result, StoreError):
            raise result
        return result

    def signature(self) -> tuple[str, str] | None:
        """The file's (crc, size) on its host: one short round trip, no body."""
        return self._call(self._sum(), self.timeout * 2 + 1)

    def whoami(self) -> tuple[str, str]:
        """The account the store's host authenticated, and this machine's name."""
        if self._user is None:
            self._call(self._ident(), self.timeout * 2 + 1)
        assert self._user is not None
        return self._user, socket.gethostname()

    def update(self, change: Callable[[StoreState, datetime], StoreState], *,
               timeout: float | None = None) -> StoreState:
        """Apply ``change`` under the host's lock and replace the file there (see Store)."""
        wait = LOCK_TIMEOUT if timeout is None else timeout
        deadline = time.monotonic() + wait
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            ch, nonce, state = self._call(self._begin(left), left + self.timeout * 2 + 1)
            try:
                now = utcnow()
                new = settle(change(state, now), now, state)
                if new.routes != state.routes:
                    check_route_owners(state, new, self.whoami()[0])
                data = None if new == state else encode(new, self._named)
                if self._call(self._finish(ch, nonce, data), self.timeout + 1):
                    return new
            finally:
                self._call(self._close(ch), self.timeout)
            # The lock file was removed while we held it, and someone may have written
            # under a new one: apply the change again to the file as it is now.
            if time.monotonic() > deadline:
                raise StoreError(f"{self.label}: the lock file kept being replaced for "
                                 f"{wait:.3g}s; nothing was changed")

    def close(self) -> None:
        """End the reader channel and the connection (the host's script exits on EOF)."""
        if self._runner is None or self._pid != os.getpid():
            return
        with contextlib.suppress(Exception):
            self._call(self._shutdown(), self.timeout)
        self._runner.stop()
        self._runner = None

    # -- plumbing ----------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        with self._runner_guard:
            if self._runner is None or self._pid != os.getpid():
                # First use, or a forked child: a loop and connection of its own (the
                # parent's are left alone: closing them here would end its session).
                self._runner, self._pid = _Loop(), os.getpid()
                self._conn = self._reader = self._reader_lock = self._conn_lock = None
                self._cache = self._down = self._retry = None
            runner = self._runner
        try:
            return runner.call(coro, timeout)
        except concurrent.futures.TimeoutError:
            raise StoreError(f"{self.label}: no answer from {self.host} in {timeout:.3g}s; "
                             "nothing was written") from None

    def _unreachable(self, why: str) -> StoreError:
        return StoreError(f"{self.label}: cannot reach {self.host} ({why}); reservations "
                          "are unknown until it answers, and nothing was written")

    def _error(self, words: list[str], wait: float = 0.0) -> StoreError:
        what = words[1] if len(words) > 1 else "?"
        if what == "big":
            size = int(words[2]) if len(words) > 2 and words[2].isdigit() else 0
            return StoreError(f"{self.label}: {size} bytes is larger than the "
                              f"{MAX_FILE_BYTES} allowed; refusing to read it (the file was "
                              "left untouched)")
        text = ERRORS.get(what, f"the store script failed ({what})")
        return StoreError(f"{self.label}: " + text.format(host=self.host, path=self.path,
                                                           wait=f"{wait:.3g}s"))

    async def _connection(self) -> asyncssh.SSHClientConnection:
        """The kept connection. The first try is waited for; once the host has failed,
        callers get that error at once while a retry runs in the background (at most every
        RETRY_S): a board or ``--watch`` reading every interval never waits out a connect
        timeout for a host that is down."""
        if self._conn is not None and not self._conn.is_closed():
            return self._conn
        if self._conn_lock is None:
            self._conn_lock = asyncio.Lock()
        async with self._conn_lock:  # a reader and a writer at once: one connection
            return await self._connection_locked()

    async def _connection_locked(self) -> asyncssh.SSHClientConnection:
        if self._conn is not None and not self._conn.is_closed():
            return self._conn
        self._reader = None
        if self._down is None:
            await self._try_connect()
        else:
            loop = asyncio.get_running_loop()
            if loop.time() >= self._down[0] and (self._retry is None or self._retry.done()):
                self._retry = loop.create_task(self._try_connect())
            raise self._unreachable(self._down[1])
        if self._conn is None:
            assert self._down is not None
            raise self._unreachable(self._down[1])
        return self._conn

    async def _try_connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._conn = await asyncio.wait_for(self._connect(), self.timeout)
        except ConnectFailed as exc:
            self._down = (loop.time() + RETRY_S, str(exc))
            return
        except (OSError, asyncssh.Error, asyncio.TimeoutError) as exc:
            why = str(exc) or type(exc).__name__
            if isinstance(exc, asyncio.TimeoutError):
                why = f"no answer in {self.timeout:g}s"
            self._down = (loop.time() + RETRY_S, why)
            return
        self._down = None

    async def _open(self, script: str) -> _Channel:
        conn = await self._connection()
        try:
            proc = await conn.create_process(script, stderr=asyncssh.DEVNULL, encoding=None)
        except (OSError, asyncssh.Error) as exc:
            conn.close()
            self._conn = None
            raise self._unreachable(f"cannot open a channel: {exc}") from None
        return _Channel(proc)

    async def _ensure_reader(self) -> _Channel:
        if self._reader is not None and self._conn is not None and not self._conn.is_closed():
            return self._reader
        ch = await self._open(READER_SCRIPT)
        nonce = secrets.token_hex(16)
        try:
            ch.write(f"{nonce}\n{self.path}\n".encode())
            words = await asyncio.wait_for(ch.marker(nonce, banner=True), self.timeout)
        except (_Closed, _Framing, asyncio.TimeoutError, OSError, asyncssh.Error) as exc:
            ch.close()
            raise self._unreachable(f"the store script did not start: {exc}") from None
        if len(words) != 3 or words[0] != "start" or words[2] == "-":
            ch.close()
            raise self._unreachable("the store script did not start (no `id -un`?)")
        self._user = words[2]
        self._reader = ch
        return ch

    async def _ident(self) -> None:
        if self._reader_lock is None:
            self._reader_lock = asyncio.Lock()
        async with self._reader_lock:
            await self._ensure_reader()

    async def _ask(self, line: str, nonce: str) -> tuple[_Channel, list[str]]:
        """One request on the reader channel (reopened once if it died since the last)."""
        if self._reader_lock is None:
            self._reader_lock = asyncio.Lock()
        for attempt in (0, 1):
            ch = await self._ensure_reader()
            try:
                ch.write(line.encode())
                words = await asyncio.wait_for(ch.marker(nonce), self.timeout)
                self.requests += 1
                return ch, words
            except (_Closed, OSError, asyncssh.Error) as exc:
                self._drop_reader()
                if attempt:
                    raise self._unreachable(f"the connection dropped: {exc}") from None
            except (_Framing, asyncio.TimeoutError) as exc:
                self._drop_reader()
                why = "no answer in time" if isinstance(exc, asyncio.TimeoutError) else exc
                raise StoreError(f"{self.label}: reading it on {self.host} failed ({why})")\
                    from None
        raise AssertionError("unreachable")

    def _drop_reader(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._reader = None

    async def _sum(self) -> tuple[str, str] | None:
        nonce = secrets.token_hex(16)
        if self._reader_lock is None:
            self._reader_lock = asyncio.Lock()
        async with self._reader_lock:
            _ch, words = await self._ask(f"{nonce} sum\n", nonce)
        if words[0] == "none":
            return None
        if words[0] == "sum" and len(words) == 3:
            return words[1], words[2]
        raise self._error(words)

    async def _read(self) -> StoreState | StoreError:
        nonce = secrets.token_hex(16)
        if self._reader_lock is None:
            self._reader_lock = asyncio.Lock()
        async with self._reader_lock:
            known = self._cache[0] if self._cache is not None else None
            ask = f"{nonce} read {known[0]} {known[1]}\n" if known else f"{nonce} read - -\n"
            ch, words = await self._ask(ask, nonce)
            if words[0] == "same" and self._cache is not None:
                return self._cache[1]
            if words[0] == "none":
                self._cache = (None, StoreState(max_s=self.max_s))
                return self._cache[1]
            if words[0] == "big":
                return self._error(["err", "big", *words[1:]])
            if words[0] != "data" or len(words) != 3:
                return self._error(words)
            try:
                raw = await asyncio.wait_for(ch.block(nonce, MAX_FILE_BYTES), self.timeout)
            except (_Closed, _Framing, asyncio.TimeoutError, OSError, asyncssh.Error) as exc:
                self._drop_reader()
                return StoreError(f"{self.label}: reading it on {self.host} failed ({exc})")
            self.fetches += 1
        try:
            result: StoreState | StoreError = self._decode(raw)
        except StoreError as exc:
            result = exc
        # Replaced between cksum and cat: keep no checksum, so the next read fetches again.
        sig = (words[1], words[2]) if words[2] == str(len(raw)) else None
        self._cache = (sig, result)
        return result

    def _decode(self, raw: bytes) -> StoreState:
        state = decode(raw, self._named)
        return state if self.max_s is None else replace(state, max_s=self.max_s)

    async def _begin(self, wait: float) -> tuple[_Channel, str, StoreState]:
        """Open a writer channel; return it with the file's state read under the lock."""
        ch = await self._open(WRITER_SCRIPT)
        nonce = secrets.token_hex(16)
        hold = max(1, math.ceil(self.hold_s))
        try:
            try:
                ch.write(f"{nonce}\n{self.path}\n{math.ceil(wait)}\n{hold}\n".encode())
                words = await asyncio.wait_for(ch.marker(nonce, banner=True),
                                               wait + self.timeout)
                if words[0] == "err":
                    raise self._error(words, wait)
                if words[0] == "none":
                    return ch, nonce, StoreState(max_s=self.max_s)
                if words[0] != "data" or len(words) != 2:
                    raise StoreError(f"{self.label}: unexpected answer from {self.host}")
                raw = await asyncio.wait_for(ch.block(nonce, MAX_FILE_BYTES), self.timeout)
            except asyncio.TimeoutError:
                raise StoreError(f"{self.label}: no answer from {self.host} in time; "
                                 "nothing was written") from None
            except (_Closed, _Framing, OSError, asyncssh.Error) as exc:
                raise self._unreachable(f"the write's channel failed: {exc}") from None
            return ch, nonce, self._decode(raw)
        except BaseException:
            ch.close()  # EOF on the script's stdin: it exits, and its lock goes with it
            raise

    async def _finish(self, ch: _Channel, nonce: str, data: bytes | None) -> bool:
        """``keep`` (nothing changed) or the new bytes, then wait for the script's word:
        False when the lock file was replaced meanwhile (nothing written: try again)."""
        try:
            if data is None:
                ch.write(f"{nonce} keep\n".encode())
            else:
                if not data.endswith(b"\n"):
                    raise StoreError(f"{self.label}: refusing to send a file without a final "
                                     "newline")
                ch.write(f"{nonce} write {len(data)}\n".encode() + data
                         + f"{MARK} {nonce} commit\n".encode())
                # awk reads its input in blocks (mawk until a block is full or EOF): the
                # end of stdin lets it see the commit line. A client that dies before that
                # line leaves EOF without it: the temp file is dropped, nothing written.
                ch.proc.stdin.write_eof()
            words = await asyncio.wait_for(ch.marker(nonce), self.timeout)
        except asyncio.TimeoutError:
            raise StoreError(f"{self.label}: {self.host} did not confirm the write in "
                             f"{self.timeout:g}s; it was written whole or not at all") from None
        except (_Closed, _Framing, OSError, asyncssh.Error) as exc:
            raise StoreError(f"{self.label}: the connection to {self.host} failed during the "
                             f"write ({exc}); it was written whole or not at all") from None
        if words[0] == "err" and words[1:2] == ["moved"]:
            return False
        if words[0] == "err":
            raise self._error(words)
        if words[0] != "done":
            raise StoreError(f"{self.label}: unexpected answer from {self.host}")
        return True

    async def _close(self, ch: _Channel) -> None:
        ch.close()

    async def _shutdown(self) -> None:
        self._drop_reader()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.wait_closed(), self.timeout)
