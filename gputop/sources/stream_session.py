"""Streaming collection: one SSH session per host carries both ``nvidia-smi -lms`` loops
and the ``ps`` answers, in one framed stdout (:func:`~gputop.sources.protocol.session_script`).

A refresh then starts no process on the host: nvidia-smi initialises NVML once per loop
(seconds per GPU without persistence mode) instead of twice per refresh, and ``ps`` runs
only for pids not seen before (asked on the session's stdin). One session instead of
three: a third of the SSH set-up at cold start, and the host's relay writes about once per
refresh (the GPU sample with the apps rows that came before it), so the client wakes once.

Framing: every line on the channel starts with the tag our own awk gave it at its source
(``g`` GPU loop, ``a`` apps loop, ``p`` a ps answer); an untagged line is a framing error.
The streamed fields are numbers, uuids and driver-given names; nothing a remote user
chooses (no ``process_name``) is in either loop, and ps's lines are tagged ``p`` however
they look. Markers (a loop's exit, a ps answer's sections) carry a nonce sent on stdin.
Each loop's lines, tag removed, become samples in :mod:`gputop.sources.stream_parse`;
the host's liveness is judged from the GPU loop only.
"""

from __future__ import annotations

import asyncio
import re
import time

import asyncssh

from gputop.model import GpuInfo, HostError
from gputop.pacing import unpaced
from gputop.sources.nvidia_smi import APPS_QUERY, GPU_FIELDS, GPU_QUERY, classify_failure
from gputop.sources.protocol import (
    MARK,
    OWNER_SECTIONS,
    FramingError,
    LineReader,
    Section,
    end_line,
    new_nonce,
    session_script,
    split_frame,
    start_pid,
)
from gputop.sources.stream_parse import AppsBatches, GpuSampler
from gputop.ssh.transport import ParseError
from gputop.text import excerpt

#: How much of a failing loop's output is kept to classify its failure.
FAILURE_TEXT = 64 * 1024


def session_command(interval: float, args_wait_s: int = 3) -> str:
    """The whole session's command for ``interval`` seconds (``-lms``, >= 100 ms); command
    lines are given up on after ``args_wait_s``."""
    ms = max(100, round(interval * 1000))
    fmt = "--format=csv,noheader,nounits"
    return session_script(f"nvidia-smi --query-gpu={GPU_QUERY} {fmt} -lms {ms}",
                          f"nvidia-smi --query-compute-apps={APPS_QUERY} {fmt} -lms {ms}",
                          len(GPU_FIELDS), args_wait_s)


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class NoAwk(Exception):
    """The host has no awk: the session cannot run, collect with a query per refresh."""


class SessionClosed(Exception):
    """The session ended (or failed) while a ps answer was awaited."""


_EXIT = re.compile(r"exit (\d{1,3})")


class _Channel(asyncssh.SSHClientSession[bytes]):
    """asyncssh's callbacks for a session's channel, handed to its HostSession."""

    def __init__(self, host: HostSession) -> None:
        self.host = host

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        if datatype is None:  # the channel's stderr is the login shell's, not ours
            self.host._data(data)

    def eof_received(self) -> bool:
        self.host._eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.host._lost(exc)


class HostSession:
    """One host's streaming session: both loops and ps, read by one task.

    ``seq`` counts complete GPU samples; :meth:`changed` returns whenever anything changes
    (a sample, apps rows, an error, the end of a loop), so a refresh waits without polling.
    """

    def __init__(self, conn: asyncssh.SSHClientConnection, interval: float,
                 max_output: int, args_wait_s: int = 3) -> None:
        self.conn = conn
        self.interval = interval
        self.args_wait_s = args_wait_s
        self.max_output = max_output
        self.started_at = time.monotonic()
        self.first_at: float | None = None
        self.last_at = 0.0
        self.seq = 0
        self.gpus: list[GpuInfo] = []
        #: Host-clock time of the newest GPU sample.
        self.stamp = 0.0
        self.apps = AppsBatches(interval)
        self.error: HostError | None = None
        #: A loop ended (its rc): a dead session is restarted, one that cannot stream
        #: (ended with a plain failure before any sample) makes the host fall back.
        self.ended: int | None = None
        #: Who waits for a change, until when (loop time); the one alarm for them all.
        self._waiters: list[tuple[asyncio.Future[None], float]] = []
        self._alarm: asyncio.TimerHandle | None = None
        #: Channels opened (for tests and the benchmark): one per session.
        self.channels = 0
        #: Lines read (for tests) and reads that brought data (the client's wake-ups).
        self.reads = 0
        self.pid = 0
        self._chan: asyncssh.SSHClientChannel[bytes] | None = None
        #: Until the start line came: resolved then (or failed).
        self._opened: asyncio.Future[None] | None = None
        self._banner = LineReader(64 * 1024)  # a shell startup file's banner may come first
        #: Failed or closed: what still arrives is not read (the source kills the session).
        self._dead = False
        self._nonce = ""
        self._sampler = GpuSampler()
        self._reader = LineReader(max_output)
        #: A loop whose output stopped making sense: its text, kept to classify it.
        self._bad: dict[str, tuple[list[str], str]] = {}
        self._timers: list[asyncio.TimerHandle] = []
        self._ps: tuple[str, list[str], asyncio.Future[list[str]]] | None = None
        self._ps_lock = asyncio.Lock()

    async def start(self) -> None:
        """Open the channel and read its start line (a NoAwk where the host has none)."""
        self.started_at = time.monotonic()
        self._opened = asyncio.get_running_loop().create_future()
        chan, _ = await self.conn.create_session(
            lambda: _Channel(self), session_command(self.interval, self.args_wait_s),
            encoding=None)
        self._chan = chan
        self.channels += 1
        self._nonce = new_nonce()
        chan.write(f"{self._nonce}\n".encode())
        try:
            await self._opened
        except BaseException:
            chan.close()
            raise

    # -- what the channel brings (called by asyncssh, in its packet handler) ----------------
    #
    # No task and no stream in between: a sample is parsed where its packet is read, which
    # saves the client a future and two loop turns per host per refresh. Nothing may raise
    # out of these (asyncssh would drop the whole connection): every failure is the
    # session's own error.

    def _data(self, data: bytes) -> None:
        self.reads += 1
        if self._opened is not None:
            self._opening(data)
            return
        if self._dead:
            return
        try:
            for line in self._reader.feed(data):
                self._line(line)
        except ParseError as exc:  # framing, or more output than a sample may have
            for loop in list(self._bad):  # a loop went astray first: that is the story
                self._judge(loop, None)
            self._fail(HostError("parse", str(exc)))
        except Exception as exc:  # a bug: this host's error, not the connection's end
            self._fail(HostError("error", f"{type(exc).__name__}: {excerpt(str(exc))}"))

    def _opening(self, data: bytes) -> None:
        """Lines before the start line: a shell startup file's banner may come first."""
        opened = self._opened
        assert opened is not None
        noawk = f"{MARK} {self._nonce} noawk"
        try:
            lines = self._banner.feed(data)
            for i, line in enumerate(lines):
                if line == noawk:
                    raise NoAwk("no awk on the host")
                pid = start_pid(line, self._nonce)
                if pid is not None:
                    self.pid = pid
                    self._opened = None
                    self._reader.feed(self._banner.rest())
                    for after in lines[i + 1:]:
                        if not self._dead:
                            self._line(after)
                    break
        except Exception as exc:
            self._opened = None
            self._dead = True
            if not opened.done():
                opened.set_exception(exc)
            return
        if self._opened is None and not opened.done():
            opened.set_result(None)

    def _eof(self) -> None:
        # The channel's close (with the exit status) normally follows at once.
        self._later(2.0, lambda: self._lost(None))

    def _lost(self, exc: Exception | None) -> None:
        if self._opened is not None:
            opened, self._opened = self._opened, None
            if not opened.done():
                opened.set_exception(ParseError(
                    "the remote shell did not run the gputop session") if exc is None
                    else exc)
            return
        if self._dead:
            return
        if exc is not None:
            self._fail(HostError("ssh", f"the nvidia-smi session broke: {excerpt(str(exc))}"))
            return
        self._dead = True  # once: the EOF's fallback timer may come after the close
        chan = self._chan
        rc = chan.get_exit_status() if chan is not None else None
        self._end(-1 if rc is None else rc)

    def _line(self, line: str) -> None:
        tag, x = line[:2], line[2:]
        if tag == "g ":
            self._gpu(x)
        elif tag == "a ":
            self._apps_line(x)
        elif tag == "p ":
            self._ps_line(x)
        else:
            raise FramingError(f"untagged line in the nvidia-smi session: {excerpt(line)}")

    def _exit_rc(self, x: str) -> int | None:
        if not x.startswith(MARK):  # (every row but a marker: no string built per line)
            return None
        prefix = f"{MARK} {self._nonce} "
        m = _EXIT.fullmatch(x[len(prefix):]) if x.startswith(prefix) else None
        return int(m.group(1)) if m else None

    def _gpu(self, x: str) -> None:
        rc = self._exit_rc(x)
        if "g" in self._bad:
            if rc is not None:
                self._judge("g", rc)
            else:
                self._keep("g", x)
            return
        if rc is not None:
            self._gpu_exit(rc)
            return
        if not x.strip():
            return  # the marker's own line break
        try:
            gpus = self._sampler.feed(x)
        except ParseError as exc:
            self._spoilt("g", self._sampler.text, str(exc))
            return
        if gpus is not None:
            self._reader.restart()  # the limit is per sample
            self._publish(gpus)

    def _gpu_exit(self, rc: int) -> None:
        text = self._sampler.text
        # After complete samples, an exit with nothing more to say (a lost GPU ends the
        # loop with 15 after the sample that shows it) is just the end: restart it.
        said = bool(text.strip()) or self.first_at is None
        failure = classify_failure(text, rc) if said else None
        if failure is not None:
            self._fail(failure)
            return
        try:
            rest = self._sampler.flush()
        except ParseError as exc:
            self._fail(HostError("parse", str(exc)))
            return
        if rest is not None:
            self._publish(rest)
        elif text.strip():
            self._fail(HostError("parse", f"nvidia-smi's stream ended mid-sample: "
                                          f"{excerpt(text)}"))
            return
        self._end(rc)

    def _apps_line(self, x: str) -> None:
        rc = self._exit_rc(x)
        if "a" in self._bad:
            if rc is not None:
                self._judge("a", rc)
            else:
                self._keep("a", x)
            return
        if rc is not None:
            # A failure (or a lost GPU) ends both loops: the GPU loop says what happened,
            # so give it a moment to say it. Either way the session is restarted.
            self._later(1.0, lambda: self._end(rc))
            return
        try:
            self.apps.feed(x)
        except ParseError as exc:
            self._spoilt("a", x, str(exc))
            return
        self._wake()

    def _spoilt(self, loop: str, text: str, why: str) -> None:
        """A loop printed what is not a sample: keep what follows for a moment, so that a
        failure nvidia-smi explains (then exits) is classified as such."""
        self._bad[loop] = ([text], why)
        self._later(0.5, lambda: self._judge(loop, None))

    def _keep(self, loop: str, x: str) -> None:
        lines = self._bad[loop][0]
        lines.append(x)
        if sum(len(t) for t in lines) >= FAILURE_TEXT:
            self._judge(loop, None)

    def _judge(self, loop: str, rc: int | None) -> None:
        lines, why = self._bad[loop]
        text = "\n".join(lines)[:FAILURE_TEXT]
        self._fail(classify_failure(text, rc) or HostError("parse", why))

    def _ps_line(self, x: str) -> None:
        if self._ps is None:
            raise FramingError(f"ps output nobody asked for: {excerpt(x)}")
        nonce, lines, fut = self._ps
        if x == end_line(nonce):
            self._ps = None
            if not fut.done():
                fut.set_result(lines)
        else:
            lines.append(x)

    @property
    def ps_pending(self) -> bool:
        """A ps request is out and unanswered: the session's shell, busy with it, would
        not see its stdin close, so ending the session needs a kill on the host."""
        return self._ps is not None

    async def ask_ps(self, pids: list[int]) -> dict[str, Section]:
        """One ps request on the session (``NONCE PIDS`` in, owners and args out)."""
        async with self._ps_lock:
            if self._chan is None or self.error is not None or self.ended is not None:
                raise SessionClosed("the nvidia-smi session has ended")
            nonce = new_nonce()
            fut: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
            self._ps = (nonce, [], fut)
            self._chan.write(f"{nonce} {','.join(str(int(p)) for p in pids)}\n".encode())
            lines = await fut
        return split_frame(lines, nonce, OWNER_SECTIONS)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut, _ in waiters:
            _settle(fut)

    async def changed(self, timeout: float) -> None:
        """Return at the next change, or after ``timeout`` seconds (or a little sooner).

        A bare future, and one alarm per session that is moved only when it is due: no
        timer armed and cancelled per waiter (a heap push and a cancelled handle per host
        per refresh); the alarm rings about once per stall limit, finds the waiters'
        deadline moved on with the samples, and re-arms."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        deadline = loop.time() + max(0.0, timeout)
        self._waiters.append((fut, deadline))
        if self._alarm is None or self._alarm.when() > deadline:
            self._arm(deadline)
        try:
            await fut
        finally:
            self._waiters = [w for w in self._waiters if w[0] is not fut]

    def _arm(self, when: float) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
        self._alarm = asyncio.get_running_loop().call_at(when, self._ring)

    def _ring(self) -> None:
        """The alarm: wake the waiters whose deadline passed, re-arm for the rest."""
        self._alarm = None
        now = asyncio.get_running_loop().time() + 0.001  # (the loop rings a hair early)
        due = [f for f, d in self._waiters if d <= now]
        self._waiters = [w for w in self._waiters if w[1] > now]
        for f in due:
            _settle(f)
        if self._waiters:
            self._arm(min(d for _, d in self._waiters))

    def _later(self, delay: float, what: object) -> None:
        assert callable(what)
        self._timers.append(asyncio.get_running_loop().call_later(delay, what))

    def _fail(self, err: HostError) -> None:
        if self.error is None and self.ended is None:
            self.error = err
        self._dead = True
        if self._chan is not None:  # stop reading: a flood then fills the window, not us
            self._chan.pause_reading()
        self._stop_ps(f"{err.kind}: {err.message}")
        self._wake()

    def _end(self, rc: int) -> None:
        if self.ended is None and self.error is None:
            self.ended = rc
        self._stop_ps(f"the nvidia-smi session ended (exit {rc})")
        self._wake()

    def _stop_ps(self, why: str) -> None:
        if self._ps is not None:
            fut = self._ps[2]
            self._ps = None
            if not fut.done():
                fut.set_exception(SessionClosed(why))

    def _publish(self, gpus: list[GpuInfo]) -> None:
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
        self.last_at = now
        self.gpus = gpus
        self.stamp = self._sampler.stamp
        self.seq += 1
        self._wake()

    @property
    def first_sample_s(self) -> float | None:
        return None if self.first_at is None else self.first_at - self.started_at

    def close(self) -> None:
        """Stop reading and close the channel: the remote script kills its process group
        when its stdin closes (:func:`~gputop.sources.protocol.session_script`)."""
        for t in self._timers:
            t.cancel()
        self._timers = []
        if self._alarm is not None:
            self._alarm.cancel()
            self._alarm = None
        self._dead = True
        self._stop_ps("the nvidia-smi session was closed")
        self._wake()  # their alarm is gone: whoever waits looks again (and re-arms it)
        if self._chan is not None:
            self._chan.close()
            self._chan = None

    async def kill(self) -> None:
        """A stalled session: kill its process group on the host, then close."""
        pid = self.pid
        self.close()
        await kill_group(self.conn, pid)


async def kill_group(conn: asyncssh.SSHClientConnection, pid: int | None) -> None:
    """Kill a remote script's whole process group (sshd made it a session leader), on a
    channel of its own. Best effort, but a connection that does not even answer the
    channel open in time is dead (streams have no keepalive): it is dropped, so the next
    refresh connects afresh. Unpaced: its four round trips must not each wait for a paced
    poll."""
    if not pid or pid <= 1:
        return
    try:
        with unpaced():
            await asyncio.wait_for(
                conn.run(f"kill -s KILL -- -{int(pid)}", check=False), timeout=1.5)
    except asyncio.TimeoutError:
        conn.abort()
    except Exception:  # noqa: S110 - best effort; the connection may be gone too
        pass
