"""Poll every host concurrently and hand out host snapshots as they arrive.

Each host has its own loop: query, publish, sleep what is left of the interval, repeat. A
query is re-armed only after the previous one finished, so a slow host never has two
queries in flight and never delays the others.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from gputop.config.load import Config
from gputop.config.tables import HostConfig
from gputop.model import FleetSnapshot, HostError, HostSnapshot, utcnow
from gputop.sources import Source
from gputop.text import excerpt

if TYPE_CHECKING:
    from gputop.ssh.transport import JumpPool


def build_sources(config: Config) -> tuple[list[Source], JumpPool | None]:
    """One source per configured host, sharing the handshake cap and jump connections."""
    from gputop.sources.nvml import NvmlSource

    handshakes = asyncio.Semaphore(config.defaults.max_connecting)
    jumps: JumpPool | None = None
    sources: list[Source] = []
    for h in config.hosts:
        if h.local:
            sources.append(NvmlSource(h.name, timeout=config.defaults.timeout))
            continue
        from gputop.sources.ssh import SshSource
        from gputop.ssh.transport import JumpPool

        if jumps is None:
            jumps = JumpPool(config.defaults.ssh_config)
        sources.append(
            SshSource(h, timeout=config.defaults.timeout, interval=config.defaults.interval,
                      ssh_config=config.defaults.ssh_config, handshakes=handshakes, jumps=jumps,
                      first_sample_timeout=config.defaults.first_sample_timeout,
                      collection=config.defaults.collection)
        )
    return sources, jumps


#: How long a host's loop has to end after a cancel before it is cancelled again.
STOP_RETRY_S = 0.5


def first_answer_s(config: Config) -> float | None:
    """How long a one-shot look waits for the hosts (``[defaults] first_answer``, at most
    the timeout); None: for every host, up to its timeout (``--wait-all``). Every command
    that answers once takes its deadline from here."""
    if config.defaults.wait_all:
        return None
    return min(config.defaults.first_answer, config.defaults.timeout)


def slow_error(deadline: float) -> HostError:
    return HostError("slow", f"no answer in {deadline:.1f} s")


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Poller:
    def __init__(self, config: Config, sources: Sequence[Source] | None = None) -> None:
        self.config = config
        self._jumps: JumpPool | None = None
        if sources is None:
            built, self._jumps = build_sources(config)
            sources = built
        self.sources = list(sources)
        self._hosts: dict[str, HostConfig] = {h.name: h for h in config.hosts}
        self._last_ok: dict[str, datetime] = {}
        self._tasks: list[asyncio.Task[None]] = []
        #: Each host's sleep between refreshes, and hosts asked for during their query.
        self._naps: dict[str, asyncio.Future[None]] = {}
        self._woken: set[str] = set()

    async def poll_host(self, source: Source) -> HostSnapshot:
        try:
            gpus, err = await source.query()
        except Exception as exc:  # a source bug must not stop this host's loop for good
            gpus, err = [], HostError("error", f"{type(exc).__name__}: {excerpt(str(exc))}")
        now = utcnow()
        if err is None:
            self._last_ok[source.name] = now
        host = self._hosts.get(source.name)
        return HostSnapshot(
            name=source.name,
            time=now,
            gpus=tuple(gpus),
            error=err,
            last_ok=self._last_ok.get(source.name),
            source=source.kind,
            tags=host.tags if host else (),
            warnings=tuple(source.warnings) if err is None else (),
            first_sample_s=source.first_sample_s,
        )

    async def snapshot(self, deadline: float | None = None) -> FleetSnapshot:
        """Every host once, concurrently; hosts in config order. With a ``deadline``
        (:func:`first_answer_s`), a host that has not answered by then is ``slow``: its
        query is cancelled (the remote command killed, see the sources' cancel paths)."""
        if deadline is None:
            hosts = await asyncio.gather(*(self.poll_host(s) for s in self.sources))
            return FleetSnapshot(hosts=tuple(hosts))
        tasks = [asyncio.ensure_future(self.poll_host(s)) for s in self.sources]
        if tasks:
            await asyncio.wait(tasks, timeout=deadline)
        late = [t for t in tasks if not t.done()]
        for t in late:
            t.cancel()
        if late:  # (a cancelled query kills its remote command: bounded, see kill_group)
            await asyncio.wait(late, timeout=2 * STOP_RETRY_S + 1.5)
        out: list[HostSnapshot] = []
        for source, task in zip(self.sources, tasks):
            if task.done() and not task.cancelled():
                out.append(task.result())
                continue
            host = self._hosts.get(source.name)
            out.append(HostSnapshot(
                name=source.name, time=utcnow(), error=slow_error(deadline),
                last_ok=self._last_ok.get(source.name), source=source.kind,
                tags=host.tags if host else ()))
        return FleetSnapshot(hosts=tuple(out))

    async def updates(self) -> AsyncIterator[HostSnapshot]:
        """Host snapshots forever, each as soon as its host answers."""
        queue: asyncio.Queue[HostSnapshot] = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._loop(s, queue)) for s in self.sources]
        try:
            while True:
                yield await queue.get()
        finally:
            await self._stop_tasks()

    async def _loop(self, source: Source, queue: asyncio.Queue[HostSnapshot]) -> None:
        name = source.name
        loop = asyncio.get_running_loop()
        answered = -1e18
        while True:
            started = loop.time()
            self._woken.discard(name)
            queue.put_nowait(await self.poll_host(source))
            now = loop.time()
            # A new streamed sample: the next query waits for the next one, so no sleep
            # (unless samples come more often than every half interval).
            since, answered = now - answered, now
            if since >= self.config.defaults.interval / 2 and source.paced:
                continue
            left = self.config.defaults.interval - (now - started)
            if left > 0 and name not in self._woken:
                await self._nap(name, left)

    async def _nap(self, name: str, seconds: float) -> None:
        """Sleep until the next refresh or a ``reconnect``. (A bare future and a timer: a
        ``wait_for`` on an event makes a task and two more loop turns per host per
        refresh, and at fleet scale the client's CPU is mostly such turns.)"""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._naps[name] = fut
        timer = loop.call_later(seconds, _settle, fut)
        try:
            await fut
        finally:
            timer.cancel()
            if self._naps.get(name) is fut:
                del self._naps[name]

    def reconnect(self, name: str) -> bool:
        """Query host ``name`` now: its source forgets its backoff (``reset``) and its loop
        stops waiting. False when no such host is polled."""
        for source in self.sources:
            if source.name == name:
                source.reset()
                self._woken.add(name)
                if (nap := self._naps.get(name)) is not None:
                    _settle(nap)
                return True
        return False

    async def _stop_tasks(self) -> None:
        """Cancel every host's loop and wait until each has ended, cancelling again while
        one runs on: before Python 3.12 a ``wait_for`` whose inner query finished in the
        same loop turn as the cancel returns the result and drops the cancel (seen at 200
        hosts, answers handled in batches: the loop went on polling and the process never
        exited on SIGINT)."""
        tasks, self._tasks = self._tasks, []
        while True:
            left = [t for t in tasks if not t.done()]
            if not left:
                break
            for t in left:
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait(left, timeout=STOP_RETRY_S)
        for t in tasks:  # (retrieved: an ended loop's exception is not "never retrieved")
            if not t.cancelled():
                t.exception()

    @property
    def connects(self) -> int:
        return sum(s.connects for s in self.sources)

    async def aclose(self) -> None:
        await self._stop_tasks()
        await asyncio.gather(*(s.close() for s in self.sources), return_exceptions=True)
        if self._jumps is not None:
            await self._jumps.close()
