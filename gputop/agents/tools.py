"""What ``gputop mcp``'s tools do, as plain data (the SDK wiring is :mod:`gputop.agents.mcp`).

Each tool returns a JSON-ready dict whose first key, ``summary``, is one line an agent can
quote, or raises :class:`ToolFailure` with a classified reason. The rules are the
commands' own: free GPUs ranked and held back for the queue as ``gputop free`` does
(:func:`~gputop.reservations.queue.offered`), all-or-nothing reservations with the
queue's claim checked under the lock, releases of your own reservations only, the
queue's wait (:func:`~gputop.jobs.wait.wait_for_gpus`), bounded in time.

The agent is its user: identity is the process's real uid, or for a store over SSH the
account its host authenticated (``whoami(store)``), never a tool argument. Everything that
comes from elsewhere (process and user names, notes, GPU names, error texts) is data:
control and escape characters dropped, cut to a bound (:mod:`gputop.agents.views`), and
never put into a summary line. Outputs are bounded: a long fleet is counted per host,
processes per GPU and list lengths are capped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from datetime import datetime
from functools import partial
from typing import Any, TypeVar

from gputop.agents.views import (
    MAX_TEXT,
    data,
    fit_doc,
    found_doc,
    gpu_doc,
    host_error,
    left,
    reservation_doc,
    waiter_doc,
)
from gputop.config.load import Config
from gputop.config.values import parse_duration
from gputop.history.known import known_gpus
from gputop.jobs.reap import check_jobs
from gputop.jobs.remote import answered_logins, logins
from gputop.jobs.wait import WaitedTooLong, describe_request, wait_for_gpus
from gputop.model import HostSnapshot, iso, utcnow
from gputop.notify.events import grant_notice
from gputop.notify.notice import Notifier
from gputop.poller import Poller, first_answer_s, slow_error
from gputop.reservations.filelock import StoreError
from gputop.reservations.flags import (
    IdleTracker,
    gpu_annotation,
    instance_index,
    reservation_index,
    share_flags,
)
from gputop.reservations.open import open_store
from gputop.reservations.ops import (
    Invalid,
    Refused,
    describe,
    format_duration,
    release,
    reserve_outcomes,
    size_text,
    whoami,
)
from gputop.reservations.order import QueueView
from gputop.reservations.queue import DEFAULT_LEASE_S, queue_claim, share_claim
from gputop.reservations.records import Reservation
from gputop.reservations.requests import Request
from gputop.reservations.shares import reserve_share, share_gpu, share_index
from gputop.reservations.state import StoreState
from gputop.reservations.summary import fleet_summary
from gputop.reservations.targets import check_targets, parse_targets, with_held
from gputop.reservations.terms import Target, Terms
from gputop.text import clean

#: Above this many GPUs, ``fleet_status`` counts each host's GPUs instead of listing them
#: (name a host or a tag for the detail).
MAX_DETAIL_GPUS = 64
#: GPUs listed for one host asked for by name (the rest are counted as left out).
MAX_HOST_GPUS = 256
#: Entries listed of reservations, the queue, found GPUs.
MAX_LIST = 100
#: ``wait_for_gpus``: its default and longest wait (an agent's call must end).
DEFAULT_WAIT_S = 60.0
MAX_WAIT_S = 600.0
#: Most GPUs one call may ask for.
MAX_COUNT = 64

_T = TypeVar("_T")


class ToolFailure(Exception):
    """A tool's error, with a classified reason: ``invalid`` (the request itself),
    ``refused`` (someone else's reservation, or the queue's claim), ``store`` (the shared
    file cannot be read or written)."""

    def __init__(self, kind: str, message: str, reason: str = "",
                 holders: Sequence[Reservation] = ()) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
        #: The refusal's own reason (gputop.errors), e.g. ``queue`` or ``not-yours``.
        self.reason = reason or kind
        self.holders = tuple(holders)


class FleetTools:
    """The tools over one config: one poller (one kept SSH connection per host, one query
    per look) and the shared reservations file, for the life of the server."""

    def __init__(self, config: Config, poller: Poller | None = None) -> None:
        self.config = config
        # The one store factory: a path here, or HOST:/path over SSH (read with
        # max_duration, so a far expiry counts as created + max_duration).
        self.store = open_store(config)
        #: Who you are for this store (``identity``): the real uid's login, or for a
        #: store over SSH the account its host authenticated. "" until known.
        self.me = ""
        #: The account this gputop logs in as on each host: your processes there are yours.
        self.login = logins(config)
        self.fleet = [h.name for h in config.hosts]
        self.poller = poller or Poller(config.with_defaults(collection="query"))
        self.tracker = IdleTracker(config.defaults.idle_holder_s, config.reservations.idle_grace_s)
        #: Where ``wait_for_gpus(notify=True)`` hands its grant (None: no [notify] sender).
        self.notifier: Notifier | None = None
        #: Above this many GPUs, ``fleet_status`` counts them per host.
        self.max_detail = MAX_DETAIL_GPUS
        #: One query at a time per host (two tools asking at once share nothing else).
        self._asking: dict[str, asyncio.Lock] = {}
        #: Queries past a look's deadline, left to finish (their answers feed the tracker).
        self._late: set[asyncio.Task[HostSnapshot]] = set()

    async def identity(self) -> str:
        """``me``, found once: a store over SSH asks its host (off the event loop)."""
        if not self.me:
            try:
                self.me = (await asyncio.to_thread(whoami, self.store))[0]
            except StoreError as exc:
                raise ToolFailure("store", f"who you are for the shared file is not known: "
                                  f"{exc}") from None
        return self.me

    async def aclose(self) -> None:
        for t in self._late:
            t.cancel()
        if self._late:
            await asyncio.wait(self._late, timeout=3.0)
        await self.poller.aclose()

    # -- what every tool needs ------------------------------------------------------------

    def _hosts_of(self, host: str | None = None, hosts: Sequence[str] | None = None,
                  tag: str | None = None) -> tuple[str, ...]:
        """The host names asked for (empty: every host), each one checked."""
        names = [*(hosts or ()), *([host] if host else [])]
        if tag and names:
            raise ToolFailure("invalid", "give hosts or a tag, not both")
        for n in names:
            if n not in self.fleet:
                raise ToolFailure("invalid", f"unknown host {data(n, 60)!r}; hosts: "
                                  + ", ".join(self.fleet[:50]))
        if tag:
            names = [h.name for h in self.config.hosts if tag in h.tags]
            if not names:
                tags = sorted({t for h in self.config.hosts for t in h.tags})
                raise ToolFailure("invalid", f"no host has the tag {data(tag, 60)!r}; tags: "
                                  + (", ".join(tags[:50]) or "none"))
        return tuple(dict.fromkeys(names))

    async def look(self, names: Sequence[str] = (), deadline: float | None = None
                   ) -> list[HostSnapshot]:
        """One query per host asked for (all: ``names`` empty), concurrently, in config
        order; each host fails alone with its classified reason. With a ``deadline``, a
        host that has not answered by then is ``slow``; its query goes on (the server keeps
        its connection), bounded by the timeout."""
        want = set(names) if names else None
        sources = [s for s in self.poller.sources if want is None or s.name in want]

        async def ask(source: Any) -> HostSnapshot:
            lock = self._asking.setdefault(source.name, asyncio.Lock())
            async with lock:
                h: HostSnapshot = await self.poller.poll_host(source)
            self.tracker.observe(h)
            return h

        if deadline is None:
            return list(await asyncio.gather(*(ask(s) for s in sources)))
        tasks = [asyncio.ensure_future(ask(s)) for s in sources]
        if tasks:
            await asyncio.wait(tasks, timeout=deadline)
        out: list[HostSnapshot] = []
        for source, task in zip(sources, tasks):
            if task.done():
                out.append(task.result())
                continue
            self._late.add(task)
            task.add_done_callback(self._late.discard)
            host = self.config.host(source.name)
            out.append(HostSnapshot(name=source.name, time=utcnow(), source=source.kind,
                                    tags=host.tags if host else (),
                                    error=slow_error(deadline)))
        return out

    async def _off_loop(self, fn: Callable[[], _T]) -> _T:
        """A store read or write (file locks) off the event loop, its errors classified."""
        with _classified():
            return await asyncio.to_thread(fn)

    async def _state(self) -> StoreState:
        return await self._off_loop(self.store.read)

    async def _reap(self) -> None:
        """Job-tied reservations of yours whose job ended go first, as in the commands."""
        try:
            if any(r.job is not None and r.user == self.me
                   for r in (await asyncio.to_thread(self.store.read)).reservations):
                await check_jobs(self.config, self.store)
        except StoreError:
            pass  # reported by the read that follows

    def _seconds(self, duration: str | None) -> float:
        if duration is None:
            return self.config.reservations.default_s
        try:
            seconds = parse_duration(duration)
        except ValueError:
            seconds = 0.0
        if not 0 < seconds <= self.config.reservations.max_s:
            raise ToolFailure("invalid", f"duration {data(duration, 40)!r}: more than zero and "
                              f"at most {format_duration(self.config.reservations.max_s)}, "
                              "e.g. '30m', '2h', '1d'")
        return seconds

    def _request(self, count: int, min_free_memory_gib: float, hosts: Sequence[str] | None,
                 tag: str | None, *, one_host: bool = False) -> Request:
        if not 1 <= count <= MAX_COUNT:
            raise ToolFailure("invalid", f"count must be between 1 and {MAX_COUNT}")
        if not 0 <= min_free_memory_gib <= 1 << 20:  # (NaN fails too)
            raise ToolFailure("invalid", "min_free_memory_gib must be 0 or more")
        names = self._hosts_of(hosts=hosts, tag=tag)
        want = f"--tag {tag}" if tag else (f"--host {names[0]}" if len(names) == 1 else "")
        return Request(count, int(min_free_memory_gib * 1024), names, one_host, want)

    def _gpu(self, h: HostSnapshot, g: Any, held: Any, inst_held: Any, shared: Any,
             free: set[str], now: datetime) -> dict[str, Any]:
        shares = shared.get((h.name, g.index), ()) if g.index is not None else ()
        if shares:
            flags, _per = share_flags(h.name, g, shares, self.tracker, now)
            ann: Any = (None, flags, ())
        else:
            ann = gpu_annotation(h.name, g, held, inst_held, self.tracker, now)
        return gpu_doc(h.name, g, ann, f"{h.name}:{g.index}" in free, now, self.me, shares)

    # -- the tools ------------------------------------------------------------------------

    async def fleet_status(self, host: str | None = None, tag: str | None = None
                           ) -> dict[str, Any]:
        names = self._hosts_of(host=host, tag=tag)
        hosts = await self.look(names)
        now = utcnow()
        try:
            state: StoreState | None = await asyncio.to_thread(self.store.read)
            problem = None
        except StoreError as exc:  # reported, and the fleet shown without reservations
            state, problem = None, str(exc)
        held, inst_held = reservation_index(state, now), instance_index(state, now)
        shared = share_index(state, now)
        free = {f.label for f in QueueView(state, hosts, now, self.fleet, self.me).offered(
            Request(1), whole=True)} if state else set()
        ngpus = sum(len(h.gpus) for h in hosts)
        detail = ngpus <= self.max_detail or bool(names)
        counts = {"free": 0, "queued": 0, "busy": 0, "reserved": 0, "mine": 0, "shared": 0,
                  "lost": 0}
        out = []
        for h in hosts:
            gpus = [self._gpu(h, g, held, inst_held, shared, free, now) for g in h.gpus]
            here = {k: sum(1 for g in gpus if g["state"] == k) for k in counts}
            for k, n in here.items():
                counts[k] += n
            doc: dict[str, Any] = {"host": h.name, "status": "ok" if h.ok else "error",
                                   "error": host_error(h), "last_ok": iso(h.last_ok),
                                   "tags": list(h.tags)}
            if detail:
                doc["gpus"] = gpus[:MAX_HOST_GPUS]
                if len(gpus) > MAX_HOST_GPUS:  # (a host that lists thousands: bounded)
                    doc["gpus_left_out"] = len(gpus) - MAX_HOST_GPUS
            else:
                doc["gpu_counts"] = here | {"total": len(gpus)}
            out.append(doc)
        down = [h.name for h in hosts if not h.ok]
        queue = state.waiting(now) if state else []
        fleet = fleet_summary(hosts, state, now)
        g = fleet["gpus"]
        extra = [f"{g[c]} {c}" for c in ("shared", "down", "unknown") if g[c]]
        insts = fleet["instances"]
        summary = (f"{len(hosts)} host(s), {len(hosts) - len(down)} up"
                   + (f", {len(down)} down ({', '.join(down[:5])}"
                      + (", ...)" if len(down) > 5 else ")") if down else "")
                   + f"; {ngpus} GPU(s): {g['free']} free, {g['busy']} busy, "
                   f"{g['reserved']} reserved" + "".join(f", {e}" for e in extra)
                   + (f"; MIG instances: {insts['free']} free of {insts['total']}"
                      if insts["total"] else "")
                   + f"; for you: {counts['free']} free"
                   + (f", {counts['queued']} idle but kept for the queue" if counts["queued"]
                      else "")
                   + f", {counts['mine']} yours"
                   + f"; {len(queue)} waiting in the queue"
                   + ("" if detail else "; counts only: name a host or tag for each GPU")
                   + ("; the reservations file could not be read" if problem else ""))
        doc = {"summary": summary, "fleet": fleet, "time": iso(now), "you": data(self.me, 64),
               "hosts": out, "queue_waiting": len(queue)}
        if problem:
            doc["reservations_error"] = data(problem, 400)
        return doc

    async def find_gpus(self, count: int = 1, min_free_memory_gib: float = 0,
                        hosts: Sequence[str] | None = None, tag: str | None = None,
                        whole_only: bool = False, share_gib: float | None = None
                        ) -> dict[str, Any]:
        req = self._request(count, min_free_memory_gib, hosts, tag)
        share = self._share(share_gib, count, whole_only)
        await self._reap()
        looked = await self.look(req.hosts, first_answer_s(self.config))
        state = await self._state()
        now = utcnow()
        waiting = len(state.waiting(now))
        down = [{"host": h.name} | (host_error(h) or {}) for h in looked if not h.ok]
        view = QueueView(state, looked, now, self.fleet, self.me)
        if share:
            fits = view.share_offered(req, share)
            found: list[Any] = fits
            docs = [fit_doc(f, share) for f in fits[:1]]
            what = f"a {size_text(share)} share"
        else:
            found = view.offered(req, whole=whole_only)
            held = reservation_index(state, now)
            docs = [found_doc(f, r if (r := held.get((f.host, f.gpu.index or 0))) and
                              r.user == self.me else None) for f in found[:count]]
            what = f"{count} wanted"
        picked = [d["gpu"] for d in docs]
        enough = len(picked) >= count
        summary = (f"{len(picked)} free, {what}: "
                   + (", ".join(picked[:10]) if picked else "none")
                   + ("" if enough else
                      (f"; {waiting} waiting in the queue, wait_for_gpus joins it" if waiting
                       else "; wait_for_gpus waits for them"))
                   + (f"; {len(down)} host(s) did not answer" if down else ""))
        return {"summary": summary, "enough": enough, "wanted": count, "found": docs,
                "more_free": max(0, len(found) - len(docs)), "queue_waiting": waiting,
                "hosts_not_answering": down[:MAX_LIST]}

    def _share(self, share_gib: float | None, count: int | None, whole_only: bool = False
               ) -> int:
        """A share's size in MiB (0: whole GPUs)."""
        if share_gib is None:
            return 0
        if not 0 < share_gib <= 1 << 20:  # (NaN fails too)
            raise ToolFailure("invalid", "share_gib must be more than 0")
        if count not in (None, 1) or whole_only:
            raise ToolFailure("invalid", "a share is of one GPU: count 1, not whole_only")
        return max(1, int(share_gib * 1024))

    async def reserve(self, gpus: Sequence[str] | None = None, count: int | None = None,
                      duration: str | None = None, note: str = "",
                      min_free_memory_gib: float = 0, hosts: Sequence[str] | None = None,
                      tag: str | None = None, share_gib: float | None = None
                      ) -> dict[str, Any]:
        if bool(gpus) == (count is not None):
            raise ToolFailure("invalid", "give either gpus (e.g. ['gpu-01:0']) or a count")
        seconds = self._seconds(duration)
        share = self._share(share_gib, count if count is not None else len(gpus or ()))
        if len(note) > MAX_TEXT or clean(note) != note:
            raise ToolFailure("invalid", f"a note is at most {MAX_TEXT} printable characters")
        await self._reap()
        warnings: list[str] = []
        if gpus:
            if hosts or tag or min_free_memory_gib:
                raise ToolFailure("invalid", "hosts, tag and min_free_memory_gib go with a "
                                  "count, not with gpus")
            if len(gpus) > MAX_COUNT:
                raise ToolFailure("invalid", f"at most {MAX_COUNT} GPUs at once")
            try:
                targets = parse_targets([str(g) for g in gpus])
            except Invalid as exc:
                raise ToolFailure("invalid", str(exc)) from None
            self._hosts_of(hosts=[t.host for t in targets])
            looked = await self.look([t.host for t in targets])
            snaps = {h.name: h for h in looked}
            down = {h.name for h in looked if not h.ok}
            known = with_held(await self._off_loop(lambda: known_gpus(self.config, down)),
                              (await self._state()).reservations, self.me, down,
                              utcnow()) if down else None
            try:
                targets, warnings = check_targets(targets, snaps, self.me, self.login, known)
            except Invalid as exc:
                raise ToolFailure("invalid", str(exc)) from None
        else:
            assert count is not None
            req = self._request(count, min_free_memory_gib, hosts, tag)
            looked = await self.look(req.hosts)
            snaps = {h.name: h for h in looked}
            view = QueueView(await self._state(), looked, utcnow(), self.fleet, self.me)
            if share:
                targets = [Target(f.host, f.gpu.index or 0, f.gpu.uuid)
                           for f in view.share_offered(req, share)]
            else:
                targets = [Target(f.host, f.gpu.index or 0, f.gpu.uuid,
                                  f.instance.gpu_instance_id if f.instance else None)
                           for f in view.offered(req)][:count]
            if len(targets) < count:
                raise ToolFailure("refused", f"{len(targets)} free, {count} wanted (nothing "
                                  "reserved); wait_for_gpus waits your turn in the queue")
        if share:
            return await self._reserve_share(targets, share, seconds, note, snaps, warnings)
        # The queue's claim, checked again under the lock: a waiter who could use one of
        # these GPUs is served first (the agent comes after every waiter).
        check = queue_claim(targets, snaps, self.fleet, self.me, seconds=seconds)
        terms = Terms(seconds, self.config.reservations.max_s, note,
                      login=answered_logins(self.config, snaps))
        made = await self._queued(lambda: reserve_outcomes(self.store, targets, terms,
                                                           check=check))
        now = utcnow()
        done = [reservation_doc(o.reservation, now, self.me) | {"action": o.action}
                for o in made]
        until = max(o.reservation.expires for o in made)
        return {"summary": f"reserved {', '.join(d['gpu'] for d in done[:10])} for you "
                           f"({data(self.me, 64)}) until {iso(until)} ({left(until, now)} left)"
                           "; release them when done",
                "reserved": done, "warnings": [data(w, 400) for w in warnings]}

    async def _queued(self, fn: Callable[[], _T]) -> _T:
        """A reservation under the queue's claim: a refusal says what an agent does."""
        try:
            return await self._off_loop(fn)
        except ToolFailure as exc:
            if exc.reason != "queue":
                raise
            raise ToolFailure(exc.kind, exc.message + " For you (an agent): wait_for_gpus "
                              "joins the queue; the tools never skip it.") from None

    async def _reserve_share(self, targets: Sequence[Target], share: int, seconds: float,
                             note: str, snaps: dict[str, HostSnapshot], warnings: list[str]
                             ) -> dict[str, Any]:
        """A memory share of one GPU: the given one, else the best fit first (one taken
        meanwhile: the next), with the queue's claim on shares under the lock."""
        failure: ToolFailure | None = None
        for t in targets:
            try:
                g = share_gpu(snaps.get(t.host), t)
            except (Invalid, Refused) as exc:
                raise ToolFailure("invalid" if isinstance(exc, Invalid) else "refused",
                                  str(exc)) from None
            total = g.memory_total_mib
            assert total is not None
            check = share_claim(self.fleet, list(snaps.values()), share, self.me, t)
            terms = Terms(seconds, self.config.reservations.max_s, note,
                          login={t.host: self.login(t.host)}.get, share_mib=share)
            try:
                o = await self._queued(partial(reserve_share, self.store, t, total, terms,
                                               check=check))
            except ToolFailure as exc:
                failure = exc
                if len(targets) == 1 or exc.kind != "refused":
                    raise
                continue
            now = utcnow()
            r = o.reservation
            return {"summary": f"{o.action} a {size_text(share)} share of {r.target} for you "
                               f"({data(self.me, 64)}) until {iso(r.expires)} "
                               f"({left(r.expires, now)} left); use at most that much "
                               "memory, release it when done",
                    "reserved": [reservation_doc(r, now, self.me) | {"action": o.action}],
                    "warnings": [data(w, 400) for w in warnings]}
        assert failure is not None
        raise failure

    async def release(self, gpus: Sequence[str] | None = None, all_mine: bool = False
                      ) -> dict[str, Any]:
        if bool(gpus) == all_mine:
            raise ToolFailure("invalid", "give either gpus (e.g. ['gpu-01:0']) or all_mine")
        targets: list[Target] | None = None
        if gpus:
            try:
                targets = parse_targets([str(g) for g in gpus][:MAX_COUNT])
            except Invalid as exc:
                raise ToolFailure("invalid", str(exc)) from None
            if any(t.uuid for t in targets):
                raise ToolFailure("invalid", "give a MIG instance as HOST:GPU/INSTANCE")
            self._hosts_of(hosts=[t.host for t in targets])
        # Never force: an agent releases only its user's own reservations.
        try:
            gone = await self._off_loop(lambda: release(self.store, targets))
        except ToolFailure as exc:
            if exc.reason != "not-yours":
                raise
            now = utcnow()
            raise ToolFailure("refused", "; ".join(describe(r, now) for r in exc.holders)
                              + "; only its holder releases it", exc.reason) from None
        names = [r.target for r in gone]
        return {"summary": ("released " + ", ".join(names[:10]) + (", ..." if len(names) > 10
                                                                  else "")
                            if names else "nothing to release: none of these is yours now"),
                "released": names[:MAX_LIST]}

    async def my_reservations(self) -> dict[str, Any]:
        await self._reap()
        state = await self._state()
        now = utcnow()
        mine = sorted((r for r in state.active(now) if r.user == self.me),
                      key=lambda r: (r.host, r.gpu, r.instance or -1))
        places = [(i + 1, w) for i, w in enumerate(state.waiting(now)) if w.user == self.me]
        summary = (f"you ({data(self.me, 64)}) hold {len(mine)} reservation(s)"
                   + (": " + ", ".join(f"{r.target} ({left(r.expires, now)} left)"
                                       for r in mine[:10]) if mine else "")
                   + ("; waiting in the queue at position(s) "
                      + ", ".join(str(p) for p, _ in places) if places else ""))
        return {"summary": summary, "you": data(self.me, 64),
                "reservations": [reservation_doc(r, now, self.me) for r in mine[:MAX_LIST]],
                "waiting": [waiter_doc(w, p, self.me) for p, w in places]}

    async def queue_status(self) -> dict[str, Any]:
        state = await self._state()
        now = utcnow()
        queue = state.waiting(now)
        active = state.active(now)
        mine = [i + 1 for i, w in enumerate(queue) if w.user == self.me]
        summary = (f"{len(queue)} waiting"
                   + (f" (the first for {queue[0].count} GPU(s))" if queue else "")
                   + (f"; you at position(s) {', '.join(map(str, mine))}" if mine else "")
                   + f"; {len(active)} reservation(s) held")
        return {"summary": summary,
                "queue": [waiter_doc(w, i + 1, self.me) for i, w in enumerate(queue[:MAX_LIST])],
                "more_waiting": max(0, len(queue) - MAX_LIST),
                "reservations": [reservation_doc(r, now, self.me) for r in sorted(
                    active, key=lambda r: (r.host, r.gpu, r.instance or -1))[:MAX_LIST]]}

    async def wait_for_gpus(self, count: int = 1, min_free_memory_gib: float = 0,
                            hosts: Sequence[str] | None = None, tag: str | None = None,
                            duration: str | None = None, note: str = "",
                            max_wait_s: float = DEFAULT_WAIT_S,
                            one_host: bool = False, share_gib: float | None = None,
                            notify: bool = False) -> dict[str, Any]:
        if notify and self.notifier is None:
            raise ToolFailure("invalid", "notify: this server has no [notify] sender")
        if not 1 <= max_wait_s <= MAX_WAIT_S:  # (NaN fails too)
            raise ToolFailure("invalid", f"max_wait_s must be between 1 and {MAX_WAIT_S:g}")
        share = self._share(share_gib, count)
        req = replace(self._request(count, min_free_memory_gib, hosts, tag,
                                    one_host=one_host or bool(share)), share_mib=share)
        seconds = self._seconds(duration)
        if len(note) > MAX_TEXT or clean(note) != note:
            raise ToolFailure("invalid", f"a note is at most {MAX_TEXT} printable characters")
        said: list[str] = []

        def say(msg: str) -> None:
            said.append(data(msg) or "")
            del said[:-5]  # the last few: where it stood

        await self._reap()
        try:
            with _classified():
                got = await wait_for_gpus(self.config, self.store, req,
                                          seconds=seconds,
                                          note=note, lease_s=DEFAULT_LEASE_S,
                                          max_wait=max_wait_s, say=say)
        except ToolFailure as exc:
            if exc.kind == "invalid":  # never possible as asked: waiting again cannot help
                raise ToolFailure(exc.kind, exc.message + ". Calling wait_for_gpus again "
                                  "cannot help.") from None
            raise
        except WaitedTooLong:
            status = await self.queue_status()
            return {"summary": f"not granted within {max_wait_s:g}s, left the queue (nothing "
                               f"reserved): {status['summary']}; call again to wait longer",
                    "granted": False, "messages": said, "queue": status["queue"]}
        now = utcnow()
        if notify and self.notifier is not None and got:  # (in-process: never blocks)
            self.notifier.submit(grant_notice(self.me, f"granted:mcp:{got[0].id}", got))
        done = [reservation_doc(r, now, self.me) for r in got]
        return {"summary": f"granted {describe_request(req)}: reserved "
                           f"{', '.join(d['gpu'] for d in done[:10])} for you until "
                           f"{done[0]['until'] if done else '?'}; release them when done",
                "granted": True, "reserved": done, "messages": said}


@contextlib.contextmanager
def _classified() -> Iterator[None]:
    """A store operation's refusal, bad input or store error as the tool's classified
    failure (what the agent is told)."""
    try:
        yield
    except Refused as exc:
        raise ToolFailure("refused", str(exc), exc.reason, exc.holders) from None
    except Invalid as exc:
        raise ToolFailure("invalid", str(exc), exc.reason) from None
    except StoreError as exc:
        raise ToolFailure("store", str(exc), exc.reason) from None
