"""Reading a hub instead of the hosts: :class:`HubPoller` gives ``Poller``'s interface over a
hub's snapshot and event stream, and :func:`open_poller` picks the hub or the hosts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from gputop.config.load import Config
from gputop.model import FleetSnapshot, HostError, HostSnapshot
from gputop.poller import Poller, _settle
from gputop.sources import Source

if TYPE_CHECKING:
    from gputop.sources import HubError


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
        from gputop.hubclient.client import HubClient, read_token

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
        self._doc: Any = None  # the hub's document as last read (gputop.hubclient.client.Document)
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
        from gputop.hubclient.client import fleet_from_document
        from gputop.sources import HubError

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
        from gputop.hubclient.client import (
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
