"""Poll every host concurrently and hand out host snapshots as they arrive.

Each host has its own loop: query, publish, sleep what is left of the interval, repeat. A
query is re-armed only after the previous one finished, so a slow host never has two
queries in flight and never delays the others.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from gputop.config import Config, HostConfig
from gputop.model import FleetSnapshot, HostError, HostSnapshot, utcnow
from gputop.sources import Source
from gputop.text import excerpt

if TYPE_CHECKING:
    from gputop.sources import HubError
    from gputop.sources.transport import JumpPool


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
        from gputop.sources.transport import JumpPool

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


# --- reading a hub instead ------------------------------------------------------------------


class _Named:
    """What readers of ``Poller.sources`` use of a source: its name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.connects = 0


#: How long a reader waits before opening a hub's stream again (doubling up to the last).
HUB_RETRY_S = (0.5, 1.0, 2.0, 5.0)


class HubPoller:
    """``Poller``'s interface over a hub (``[hub] url`` / ``--hub``): the snapshot for
    one look, the event stream for the board and ``--watch``. With hosts in the config,
    those are the hosts shown (one the hub does not poll says so); without, the hub's.

    A hub that is down or answers garbage is a :class:`HubError` for one look; on a
    stream, every host shows that error (classified: ``unreachable``, ``timeout``,
    ``auth``, ``parse``) until the stream is back, resumed from the last event id. With
    ``[hub] fallback = "direct"`` the hosts are polled directly instead."""

    def __init__(self, config: Config, say: Callable[[str], None] | None = None) -> None:
        from gputop.sources.hub import HubClient, read_token

        assert config.hub.url is not None
        self.config = config
        self.url = config.hub.url
        self.client = HubClient(config.hub.url, timeout=config.defaults.timeout,
                                token=read_token(config.hub.token_file))
        self.only = [h.name for h in config.hosts] or None
        self.sources: list[_Named] = [_Named(n) for n in self.only or ()]
        self.fallback = config.hub.fallback == "direct"
        self.say = say
        #: Why the hub could not be read last (None while it answers): the board's bar.
        self.error: HubError | None = None
        self._direct: Poller | None = None
        self._last: dict[str, HostSnapshot] = {}
        self._doc: Any = None  # the hub's document as last read (gputop.sources.hub.Document)
        self._wake: asyncio.Future[None] | None = None
        self.connects = 0

    @property
    def direct(self) -> bool:
        """The hub failed and ``[hub] fallback = "direct"`` polls the hosts from here."""
        return self._direct is not None

    def _names(self, doc_hosts: Sequence[str]) -> list[str]:
        have = set(doc_hosts)
        if not self._last.keys() <= have:
            # (a host the hub no longer lists is forgotten: a resume hands on the last
            # answers kept, and one of a removed host would come back with them)
            self._last = {n: h for n, h in self._last.items() if n in have}
        names = self.only if self.only is not None else list(doc_hosts)
        if [s.name for s in self.sources] != names:
            self.sources = [_Named(n) for n in names]
        return names

    def _missing(self, name: str) -> HostSnapshot:
        return HostSnapshot(name=name, source="none", error=HostError(
            "error", f"the hub {self.url} does not poll this host"))

    def _go_direct(self, exc: HubError) -> Poller:
        if self._direct is None:
            if self.say is not None:
                self.say(f"{exc}; polling the hosts directly ([hub] fallback = \"direct\")")
            self._direct = Poller(self.config.with_hub(url=None))
        return self._direct

    async def snapshot(self, deadline: float | None = None) -> FleetSnapshot:
        """The hub's document (its hosts answer the hub, not this look: ``deadline`` only
        bounds the hosts polled directly after a fallback)."""
        from gputop.sources import HubError
        from gputop.sources.hub import fleet_from_document

        try:
            doc = await self.client.snapshot()
        except HubError as exc:
            self.error = exc
            if not self.fallback:
                raise
            return await self._go_direct(exc).snapshot(deadline)
        self.connects += 1
        fleet = fleet_from_document(doc)
        by_name = {h.name: h for h in fleet.hosts}
        names = self._names([h.name for h in fleet.hosts])
        return FleetSnapshot(hosts=tuple(by_name.get(n) or self._missing(n) for n in names),
                             time=fleet.time)

    async def updates(self) -> AsyncIterator[HostSnapshot]:
        from gputop.sources import HubError

        last_id: str | None = None
        retry = 0
        while True:
            try:
                async for snap in self._stream(last_id):
                    if isinstance(snap, str):
                        last_id = snap
                        retry = 0
                        self.error = None
                        continue
                    yield snap
            except HubError as exc:
                self.error = exc
                if self._doc is None:
                    last_id = None  # (a broken event: a fresh snapshot, not the same again)
                if self.fallback:
                    async for snap in self._go_direct(exc).updates():
                        yield snap
                    return
                if not self.sources:  # no host known yet: the hub itself is the row
                    self.sources = [_Named("hub")]
                for name in [s.name for s in self.sources]:
                    prev = self._last.get(name)
                    yield HostSnapshot(name=name, source="none", error=exc.host_error(),
                                       last_ok=prev.last_ok if prev else None,
                                       tags=prev.tags if prev else ())
            await self._nap(HUB_RETRY_S[min(retry, len(HUB_RETRY_S) - 1)])
            retry += 1

    async def _stream(self, last_id: str | None) -> AsyncIterator[HostSnapshot | str]:
        """The hosts each event changed, then (a str) the event's id once it is applied."""
        from gputop.sources.hub import (
            Document,
            check_document,
            check_patch,
            check_update,
            parse_json,
        )

        doc: Document | None = self._doc if last_id else None
        resumed = doc is not None
        async for event, eid, data in self.client.stream(last_id, patches=True):
            if resumed and event in ("update", "patch"):
                # Back within the hub's window: only what changed since comes, so the
                # hosts shown as "hub down" meanwhile get their last data back first.
                for h in list(self._last.values()):
                    yield h
            resumed = False
            try:
                if event == "snapshot":
                    doc = Document(check_document(parse_json(data)))
                    self._doc = doc
                    self.connects += 1
                    changed: list[tuple[dict[str, Any], dict[int, dict[str, Any]] | None]] = [
                        (h, None) for h in doc.doc["hosts"]]
                    names = self._names(doc.order)
                    have = set(doc.order)
                    for n in names:
                        if n not in have:
                            yield self._missing(n)
                elif event == "update" and doc is not None:
                    changed = [(h, None) for h in doc.apply(check_update(parse_json(data)))]
                    self._names(doc.order)
                elif event == "patch" and doc is not None:
                    changed = doc.apply_patch(*check_patch(parse_json(data)))
                    self._names(doc.order)
                else:
                    continue
                hosts = [doc.model(h, pos) for h, pos in changed]
            except Exception as exc:
                # What was read no longer matches the hub's document: never resume on it.
                self._doc = None
                raise self.client._fail(exc) from None
            for h in hosts:
                if self.only is None or h.name in self.only:
                    self._last[h.name] = h
                    yield h
            if eid:
                yield eid

    async def _nap(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._wake = fut
        timer = loop.call_later(seconds, _settle, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._wake = None

    def reconnect(self, name: str) -> bool:
        """A hub's host cannot be reconnected from here: this only retries the hub now."""
        if self._direct is not None:
            return self._direct.reconnect(name)
        if self._wake is not None:
            _settle(self._wake)
        return any(s.name == name for s in self.sources)

    async def aclose(self) -> None:
        await self.client.close()
        if self._direct is not None:
            await self._direct.aclose()


def open_poller(config: Config, sources: Sequence[Source] | None = None, *,
                one_look: bool = False, say: Callable[[str], None] | None = None
                ) -> Poller | HubPoller:
    """The hub when one is configured (and no sources are given), else the hosts;
    ``one_look``: one query per host (cheaper than starting streams for one document)."""
    if sources is None and config.hub.url is not None:
        return HubPoller(config, say=say)
    return Poller(config.with_defaults(collection="query") if one_look else config,
                  sources)
