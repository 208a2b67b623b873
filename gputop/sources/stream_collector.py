"""Streaming mode: the one nvidia-smi session per host, and what it takes to keep it.

The session (:class:`~gputop.sources.stream_session.HostSession`, which frames and parses what it
sends) runs both ``nvidia-smi -lms`` loops on one exec channel and answers ``ps`` for new
pids on its stdin; a refresh reads the next sample and starts nothing on the host. Here:
opening it in the background (the host is ``starting`` meanwhile), restarting it when it
ends, killing it when it stalls, the owners of its processes (asked once per process,
remembered across late samples), and when a host cannot stream (:class:`CannotStream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time

import asyncssh

from gputop.model import HostError
from gputop.pacing import unpaced
from gputop.sources.nvidia_smi import (
    AppRow,
    Owner,
    RemoteResult,
    attach_processes,
    index_warnings,
    parse_args_rows,
    parse_owner_rows,
)
from gputop.sources.protocol import MAX_OUTPUT
from gputop.sources.stream_session import HostSession, NoAwk, SessionClosed
from gputop.ssh.transport import ChannelClosed, HostLink, PhaseTimeout

#: A streaming host's first sample waits this long (at most one interval) for the apps
#: loop's first rows: it prints nothing while no process runs.
FIRST_APPS_WAIT_S = 1.0
#: ...and then this long for the rest of that first batch.
SETTLE_S = 0.05

#: Intervals a pid may be missing from the samples and keep the owner ps gave for it.
OWNER_MEMORY = 3


class CannotStream(Exception):
    """This host cannot stream (the message says why): collect with a query per refresh."""


@functools.lru_cache(maxsize=64)
def _persistence_warning(off: tuple[int | None, ...]) -> str:
    """(The same words every sample: worked out once per set of GPUs.)"""
    return (f"persistence mode is off on GPU {', '.join(str(i) for i in off)}: every "
            "nvidia-smi start initialises the GPU again; enable nvidia-persistenced")


class StreamCollector:
    """A host's streaming session and the state that outlives one session: its owners,
    restarts, kills under way and the first sample's deadline."""

    def __init__(self, link: HostLink, *, timeout: float, interval: float,
                 first_sample_timeout: float) -> None:
        self._link = link
        self.timeout = timeout
        self.interval = interval
        self.first_sample_timeout = first_sample_timeout
        self.max_output = MAX_OUTPUT
        #: The running session, if any.
        self.session: HostSession | None = None
        self._first_deadline = 0.0
        self._opening: asyncio.Task[None] | None = None
        self._short_streams = 0
        self._kills: set[asyncio.Task[None]] = set()
        self._seen_seq = 0
        self._starting = False
        #: The last answer was a new sample: the poller queries again at once (the query
        #: waits for the next sample) instead of sleeping first. Reset by the caller.
        self.paced = False
        #: Owners and command lines of the pids in the last sample, and when ps was asked.
        #: pid -> (owner, command line, when ps answered, when last in a sample, start)
        self._owners: dict[int, tuple[Owner, str | None, float, float, str | None]] = {}
        #: Probe cost: seconds the last stream took to its first sample.
        self.first_sample_s: float | None = None
        #: Sessions started and exec channels they opened, for tests and the benchmark.
        self.starts = 0
        self.channels = 0

    async def query(self) -> RemoteResult:
        """The next GPU sample of this host's session (waiting for it), with processes.

        Connects where the host has no connection, starts the session when there is none;
        restarts it (once per refresh) when it ended; a session with no sample for
        ``max(timeout, 3 x interval)`` is a timeout and is killed on the host (the caller's
        backoff then delays the restart). Before the first sample the host is ``starting``
        until ``first_sample_timeout``. Raises :class:`CannotStream` for a host that cannot.
        """
        asked = time.monotonic()
        if not self._link.connected():
            self._first_deadline = asked + self.first_sample_timeout  # connecting included
            self.stop()
            await self._link.open()
        if self.session is None:
            try:
                starting = await self._await_session(asked)
            except NoAwk:
                raise CannotStream("no awk on the host") from None
            if starting is not None:
                return starting
        elif self._opening is not None:
            # It opened between two refreshes (the last one gave up on it: `starting`), and
            # ended with that: the next session to open is a new one.
            self._opening = None
        restarted = False
        while True:
            st, conn = self.session, self._link.conn
            assert st is not None and conn is not None
            if st.error is not None:
                err = st.error
                cannot_stream = st.first_at is None and err.kind == "error"
                await st.kill()
                self.session = None
                if cannot_stream:  # e.g. an nvidia-smi without -lms: query per refresh
                    raise CannotStream(f"nvidia-smi cannot stream ({err.message})")
                return RemoteResult([], err)
            if st.seq > self._seen_seq:
                return await self._sample(st)
            if st.ended is not None:
                self._stop_session()
                # A loop that ends after every sample (e.g. a lost GPU, where nvidia-smi
                # exits 15) costs the host more than a query per refresh: fall back.
                self._short_streams = self._short_streams + 1 if st.seq <= 1 else 0
                if self._short_streams >= 3:
                    raise CannotStream("nvidia-smi's stream ends after every sample")
                if restarted:
                    raise ChannelClosed(f"nvidia-smi's stream ended (exit {st.ended})")
                self._first_deadline = time.monotonic() + self.first_sample_timeout
                try:
                    await asyncio.wait_for(self._start(conn), self.timeout)
                except NoAwk:
                    raise CannotStream("no awk on the host") from None
                restarted = True
                continue
            now = time.monotonic()
            if st.first_at is None:
                first_deadline = self._first_deadline
                wait = self.interval if self._starting else self.timeout
                until = min(first_deadline, asked + wait)
                if now >= until:
                    if now < first_deadline:
                        return self._starting_result()
                    self._kill(st)
                    raise PhaseTimeout(f"nvidia-smi sent no sample in "
                                       f"{self.first_sample_timeout:g}s (first_sample_timeout)")
            else:
                limit = max(self.timeout, 3 * self.interval)
                until = st.last_at + limit
                if now >= until:
                    self._kill(st)
                    raise PhaseTimeout(f"nvidia-smi's stream sent no sample in {limit:g}s; "
                                       "restarting it")
            await st.changed(until - now)

    async def _start(self, conn: asyncssh.SSHClientConnection) -> None:
        self._stop_session()
        # Command lines get half the timeout: a ps that cannot read one is cut short in
        # time for the refresh to show the owners (a loaded host's ps may need a second).
        session = HostSession(conn, self.interval, self.max_output,
                              args_wait_s=max(1, int(self.timeout / 2)))
        self._seen_seq = 0
        self.starts += 1
        try:
            with unpaced():
                await session.start()
        except BaseException:
            session.close()
            raise
        finally:
            self.channels += session.channels
        self.session = session

    def _kill(self, st: HostSession) -> None:
        """Kill a stalled session on the host in the background: the answer does not wait."""
        if self.session is st:
            self.session = None
        task = asyncio.create_task(st.kill())
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)

    def _stop_session(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None

    def stop(self) -> None:
        """Forget the session (and an opening under way) without waiting."""
        self._cancel_opening()
        self._stop_session()

    async def close(self) -> None:
        """End the session; one waiting on a ps, and kills already under way, are waited
        for (killed on the host): at shutdown nothing is left running there."""
        st = self.session
        if st is not None and st.ps_pending and self._link.connected():
            # Its shell waits on that ps and would not see stdin close: kill the group.
            self.session = None
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(st.kill(), timeout=2.0)
        if self._kills:  # kills of stalled sessions still under way
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait(set(self._kills), timeout=2.0)
        self.stop()

    async def _await_session(self, asked: float) -> RemoteResult | None:
        """Open the session (an SSH session set-up: on a busy host that alone takes a while).

        Opening runs on in the background and counts against ``first_sample_timeout``, not
        ``timeout``: until then the host is ``starting``, and a refresh that comes back
        finds the opening where it was instead of starting it again."""
        conn = self._link.conn
        assert conn is not None
        if self._opening is None:
            if self._first_deadline < asked:
                self._first_deadline = asked + self.first_sample_timeout
            self._opening = asyncio.create_task(self._start(conn))
        opening = self._opening
        wait = self.interval if self._starting else self.timeout
        until = min(self._first_deadline, asked + wait)
        done, _ = await asyncio.wait({opening}, timeout=max(0.0, until - time.monotonic()))
        if not done:
            if time.monotonic() < self._first_deadline:
                return self._starting_result()
            self._cancel_opening()
            if self._link.conn is not None:  # a channel open unanswered: the connection is dead
                self._link.conn.abort()
            raise PhaseTimeout(f"the nvidia-smi streams did not open in "
                               f"{self.first_sample_timeout:g}s (first_sample_timeout)")
        self._opening = None
        opening.result()  # raises what opening raised
        return None

    def _starting_result(self) -> RemoteResult:
        self._starting = True
        since = self._first_deadline - self.first_sample_timeout
        return RemoteResult([], HostError(
            "starting", f"starting nvidia-smi: {time.monotonic() - since:.0f} s"))

    def _cancel_opening(self) -> None:
        if self._opening is not None:
            self._opening.cancel()
            self._opening = None
    async def _sample(self, st: HostSession) -> RemoteResult:
        """The newest GPU sample with the apps stream's processes and their owners."""
        first = self._seen_seq == 0
        self._seen_seq = st.seq
        self.paced = True  # a new sample: the next query waits for the next one
        self._starting = False
        self.first_sample_s = st.first_sample_s
        if first and not st.apps.seen:
            # Both loops started together; the apps one prints nothing without processes.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._apps_seen(st),
                                       min(FIRST_APPS_WAIT_S, self.interval))
        gpus = st.gpus
        now = time.monotonic()
        apps = st.apps.for_sample(st.stamp)
        if apps or self._owners:
            owners, args = await self._owners_of(st, apps, now)
            gpus = attach_processes(gpus, apps, owners, args)
        warnings = index_warnings(gpus)
        off = tuple(g.index for g in gpus if g.persistence_mode == "Disabled")
        if off:
            warnings.append(_persistence_warning(off))
        return RemoteResult(gpus, None, tuple(warnings))

    @staticmethod
    async def _apps_seen(st: HostSession) -> None:
        while not st.apps.seen:
            await st.changed(FIRST_APPS_WAIT_S)
        await asyncio.sleep(SETTLE_S)  # the rest of its first batch

    async def _owners_of(self, st: HostSession, apps: list[AppRow],
                         now: float) -> tuple[dict[int, Owner], dict[int, str]]:
        """Owners and command lines: ``ps`` only for processes not seen lately. A process
        is its pid and its start time (the session appends it to each apps row): a pid
        reused by another process, even from one sample to the next, is asked again. A
        known process missing from a sample or two (a late apps batch on a loaded host)
        keeps its owner for ``OWNER_MEMORY`` intervals; where the start time is unknown
        (no /proc), only while it stays in every sample."""
        pids = list(dict.fromkeys(a.pid for a in apps))
        starts = {a.pid: a.start for a in apps}
        keep = OWNER_MEMORY * self.interval
        self._owners = {
            p: v for p, v in self._owners.items()
            if (p in starts and starts[p] == v[4])
            or (p not in starts and v[4] is not None and now - v[3] <= keep)}
        for p in pids:
            if p in self._owners:
                self._owners[p] = (*self._owners[p][:3], now, self._owners[p][4])
        new = [p for p in pids if p not in self._owners]
        if new:
            found, cmds = await self._ask_ps(st, new)
            for p in new:
                o = found.get(p)
                if o is not None:
                    self._owners[p] = (o, cmds.get(p), now, now, starts[p])
        owners: dict[int, Owner] = {}
        args: dict[int, str] = {}
        for p in pids:
            if p not in self._owners:
                continue
            o, cmd, at, _seen, _start = self._owners[p]
            age = None if o.elapsed_s is None else o.elapsed_s + int(now - at)
            owners[p] = Owner(o.pid, o.user, age)
            if cmd:
                args[p] = cmd
        return owners, args

    async def _ask_ps(self, st: HostSession,
                      pids: list[int]) -> tuple[dict[int, Owner], dict[int, str]]:
        """One round trip on the session's stdin: ``NONCE PIDS`` -> owners, args. A ps
        that hangs, or an answer whose frame does not check out, ends the session (killed
        on the host, restarted by a later refresh): that refresh is the host's error."""
        try:
            sections = await asyncio.wait_for(st.ask_ps(pids), self.timeout)
        except SessionClosed:
            # The loops ended meanwhile (e.g. a lost GPU): this sample is shown without
            # owners; the next refresh restarts the session and asks again.
            return {}, {}
        except BaseException:
            self._kill(st)
            raise
        return (parse_owner_rows(sections["owners"].text, pids),
                parse_args_rows(sections["args"].text, pids))
