"""Waiting in the queue until the order rule grants this waiter its GPUs.

One loop per waiter: each host is polled on its own loop (one refresh per interval over
the kept connections) and the waiter looks again whenever a host answers, so a hung host
delays nothing but its own GPUs. The file is read without the lock; the lock is taken only
to write: to grant (re-checked under the lock), to renew the lease (once per half lease,
on its own task) or to leave. So 50 waiters at the default interval cost a few short
writes a second. Between answers a waiter stats the file every 0.2 s: a reservation
released there is taken up at once, not at the next refresh."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

from gputop.config.load import Config, reserving_problem
from gputop.hubclient.poller import HubPoller, open_poller
from gputop.model import HostSnapshot, utcnow
from gputop.poller import Poller
from gputop.reservations.filelock import StoreError
from gputop.reservations.ops import Invalid, Refused
from gputop.reservations.queue import (
    LeftQueue,
    Queue,
    QueueView,
    Request,
    capacity,
    ceiling,
    removed_by,
    unsatisfiable,
)
from gputop.reservations.records import LAPSED_KEEP_S, Job, Reservation
from gputop.reservations.state import StoreState
from gputop.reservations.store import ReservationStore
from gputop.reservations.terms import Terms
from gputop.text import clean, excerpt

#: How often a waiter looks at the file between refreshes (a stat, no lock).
WATCH_S = 0.2


def _signature(store: ReservationStore) -> object:
    """Changes whenever the file does (a stat here; a checksum on the kept channel for a
    store over SSH). A store that cannot be asked: a fresh object, so the waiter reads."""
    try:
        return store.signature()
    except StoreError:
        return object()


async def _signature_now(store: ReservationStore) -> object:
    """``_signature`` without blocking the loop on a round trip to a remote store's host."""
    if store.remote:
        return await asyncio.to_thread(_signature, store)
    return _signature(store)


class WaitedTooLong(Exception):
    """``--max-wait`` passed before the GPUs were granted (exit code 1)."""


@dataclass
class Progress:
    """What a waiter tells its user: its place and how many are ahead of it."""

    position: int
    waiting: int


def describe_request(req: Request) -> str:
    what = (f"a {req.share_mib / 1024:g}G share of a GPU" if req.share_mib else
            f"{req.count} GPU{'s' if req.count != 1 else ''}")
    if req.min_free_mib:
        what += f" with {req.min_free_mib / 1024:g}G free"
    if req.want:
        what += f" ({excerpt(req.want, 60)})"
    elif req.one_host:
        what += " on one host"
    return what


async def wait_for_gpus(config: Config, store: ReservationStore, req: Request, *, seconds: float,
                        note: str = "", lease_s: float, max_wait: float | None,
                        say: Callable[[str], None],
                        job: Callable[[str], Job | None] | None = None,
                        poller: Poller | HubPoller | None = None,
                        reaper: Callable[[], object] | None = None,
                        verbose: bool | None = None) -> list[Reservation]:
    """Join the queue and return the reservations once granted. Cancellation (Ctrl-C,
    SIGTERM) and every error leave the queue at once; nothing is half-reserved. A request
    no host could ever meet, or for more GPUs than the known GPUs of its hosts, is refused
    before joining (Invalid, exit 2); one that becomes so while waiting leaves the queue
    the same way. It starts with one line (what it waits for, its place, the hosts not
    answering by name); ``verbose``: each such host's error too (False: the line says
    that -v does that; None, for callers without one: says nothing of it). A lock held
    by another writer for less than the lease costs nothing: the lease is renewed on its
    own task, which waits for the lock up to the lease's end, and a grant that times out
    is tried again."""
    problem = reserving_problem(config)
    if problem:  # (the CLI says so before; the board's Q learns it here)
        raise Invalid(f"the queue grants GPUs, and {problem}")
    own = poller is None
    fleet = [h.name for h in config.hosts]
    if poller is None:
        if req.hosts:  # poll only the hosts it can be granted on
            config = replace(config, hosts=tuple(h for h in config.hosts
                                                 if h.name in req.hosts))
        # A query per refresh, not the streams: a GPU is free the moment its last process
        # is gone from a query, while the apps stream can only say "no process now" by
        # staying silent for 1.5 intervals, and a waiter wants that moment (a grant within
        # one interval plus one store write). A waiter is temporary; a board is not.
        poller = open_poller(config, one_look=True, say=say)
    from gputop.jobs.remote import logins

    q = Queue(store, req, lease_s=lease_s, login=logins(config))
    started = time.monotonic()
    keeper: asyncio.Task[None] | None = None
    feeder: asyncio.Task[None] | None = None
    joining: asyncio.Future[int] | None = None
    try:
        snap = await poller.snapshot()
        known = {h.name: h.gpus for h in config.hosts if h.gpus is not None}
        why = unsatisfiable(req, list(snap.hosts), fleet) or ceiling(
            req, list(snap.hosts), fleet, known)
        if why:
            raise Invalid(f"not joining the queue: {why}; ask for fewer GPUs or less memory "
                          "(or name other hosts)")
        sight = Sight(req, fleet, say, verbose=verbose)
        q.sees = sight.look(list(snap.hosts))
        # Shielded: a cancel while the join's write is under way (it cannot be stopped on
        # its thread) must not let the leave below run before the place is in the file.
        joining = asyncio.ensure_future(asyncio.to_thread(q.join))
        pos = await asyncio.shield(joining)
        ahead = ""
        if pos > 1:  # who is ahead, as the docs promise (not only once the place changes)
            joined, now = await asyncio.to_thread(store.read), utcnow()
            if any(w.id == q.id for w in joined.waiting(now)):
                ahead = f"; {_ahead(joined, q, now)}"
        say(f"waiting for {describe_request(req)}: position {pos} in the queue{ahead}"
            + sight.first_line())
        sight.details()
        renewing: set[str] = set()
        poke = asyncio.Event()  # what it sees changed: renew (and record it) now
        keeper = asyncio.create_task(keep_lease(q, say, renewing, poke))
        # Each host's answers as they come (one loop per host): a hung host delays
        # nothing but itself; its last answer stands until its query times out.
        latest = {h.name: h for h in snap.hosts}
        changed = asyncio.Event()

        async def feed() -> None:
            async for h in poller.updates():
                latest[h.name] = h
                changed.set()

        feeder = asyncio.create_task(feed())
        last = pos
        doubt_since: float | None = None
        while True:
            if reaper is not None:
                reaper()
            hosts = list(latest.values())
            sees = sight.look(hosts)
            if sees != q.sees:
                q.sees = sees
                poke.set()
            if sight.blind_for() >= BLIND_GIVE_UP_S:
                raise CannotReach(f"left the queue: no host you wait on answered for "
                                  f"{BLIND_GIVE_UP_S:g}s ({sight.why})")
            sig = await _signature_now(store)  # before the read: a change in between is seen below
            state = store.read()
            now = utcnow()
            why = unsatisfiable(req, hosts, fleet)
            if why is None:
                doubt_since = None
            elif doubt_since is None:
                doubt_since = time.monotonic()
            elif time.monotonic() - doubt_since >= GIVE_UP_AFTER * config.defaults.interval:
                # Not a one-off odd answer: the hosts changed.
                raise Invalid(f"left the queue: the hosts changed, {why}")
            pos_now = q.position(state, now)
            if pos_now is None and renewing and any(w.id == q.id for w in state.queue):
                await asyncio.sleep(WATCH_S)  # lapsed while the lock was held: the lease
                continue                      # keeper takes it back, or it is dropped
            if pos_now is None and (by := removed_by(state, q.id)) is not None:
                q.id = ""
                raise Refused(f"{clean(by)} removed your place from the queue "
                              "(gputop release --waiter)")
            if pos_now is None:
                say("your place in the queue lapsed (lease not renewed in time); joining "
                    "again at the end")
                last = await asyncio.to_thread(q.join)
                continue
            view = QueueView(state, hosts, now, fleet)
            if view.grantable(q.id, seconds=seconds) is not None:
                got = await _try_grant(q, hosts, Terms(seconds, note=note, job=job), fleet,
                                       say)
                if got is not None:
                    return got
            elif pos_now != last:
                say(f"position {pos_now} of {len(state.waiting(now))}: "
                    f"{_ahead(state, q, now)}")
                last = pos_now
            if max_wait is not None and time.monotonic() - started >= max_wait:
                raise WaitedTooLong(f"waited {max_wait:g}s for {describe_request(req)}; still "
                                    f"position {pos_now} in the queue (left it)")
            # Until a host answers again or the file changes (a release there is acted on
            # within WATCH_S), nothing can change the answer.
            while not changed.is_set() and await _signature_now(store) == sig:
                if feeder.done():
                    feeder.result()  # the poller failed: say why
                    raise RuntimeError("host polling stopped")
                if max_wait is not None and time.monotonic() - started >= max_wait:
                    break
                if sight.blind_for() >= BLIND_GIVE_UP_S:
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), WATCH_S)
            changed.clear()
    finally:
        async def leave() -> None:
            for task in (keeper, feeder):
                if task is not None:
                    task.cancel()
            if feeder is not None:  # its host loops end before the poller closes
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await feeder
            if joining is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await joining  # the place is in the file: now it can go
            try:
                await asyncio.to_thread(_leave, q, say)
            finally:
                if own:
                    await poller.aclose()

        await run_to_end(leave())


#: For how many refresh intervals a request must look unsatisfiable before its waiter
#: gives up.
GIVE_UP_AFTER = 3
#: A waiter that reaches none of the hosts it accepts leaves the queue after this long
#: (exit 1, naming each host's error): it blocks nobody meanwhile (it sees no host), and
#: a broken set-up should not wait unnoticed for hours.
BLIND_GIVE_UP_S = 120.0


class CannotReach(WaitedTooLong):
    """No host the waiter accepts answered for BLIND_GIVE_UP_S (exit code 1)."""


class Sight:
    """What a waiter sees of the hosts it accepts: where it can be granted (recorded in
    its place, see ``grantable_on``), and which hosts it cannot reach, said on stderr at
    once and again whenever that changes."""

    def __init__(self, req: Request, fleet: list[str], say: Callable[[str], None], *,
                 verbose: bool | None = None) -> None:
        self.req, self.fleet, self.say, self.verbose = req, fleet, say, verbose
        self.accepted = set(req.hosts) if req.hosts else set(fleet)
        self.said: frozenset[str] | None = None
        self.why = ""
        self.down: list[HostSnapshot] = []
        self.blind_since: float | None = None

    def first_line(self) -> str:
        """The hosts not answering, by name, for the waiter's first line."""
        if not self.down:
            return ""
        return (f"; {len(self.down)} host(s) not answering: " + _names(self.down)
                + (" (-v says why)" if self.verbose is False else ""))

    def details(self) -> None:
        """With ``verbose``: each host not answering and its error, a line each."""
        if self.verbose:
            for h in self.down:
                if h.error is not None:
                    self.say(f"{clean(h.name)}: {h.error.kind}: "
                             f"{excerpt(h.error.message, 120)}")

    def look(self, hosts: list[HostSnapshot]) -> tuple[str, ...]:
        mine = [h for h in hosts if h.name in self.accepted]
        down = [h for h in mine if not h.ok]
        self.why = "; ".join(
            f"{clean(h.name)}: {h.error.kind}: {excerpt(h.error.message, 120)}"
            for h in down[:8] if h.error is not None) + ("; ..." if len(down) > 8 else "")
        names = frozenset(h.name for h in down)
        first = self.said is None
        self.down = down
        if names != self.said:
            if down and len(down) == len(mine):
                self.say(f"cannot reach any host you wait on ({self.why}); you block "
                         f"nobody meanwhile, and leave the queue after {BLIND_GIVE_UP_S:g}s "
                         "unless one answers")
                self.down = []  # (said in full: the first line need not repeat it)
            elif down and not first:
                self.say(f"cannot reach {len(down)} of the {len(mine)} hosts you wait on "
                         f"({_names(down)}): waiting for GPUs on the others only")
                self.details()
            elif self.said:
                self.say("every host you wait on answers again")
            self.said = names
        if mine and len(down) == len(mine):
            if self.blind_since is None:
                self.blind_since = time.monotonic()
        else:
            self.blind_since = None
        return tuple(sorted(capacity(self.req, hosts, self.fleet, known_only=True)[0]))

    def blind_for(self) -> float:
        return 0.0 if self.blind_since is None else time.monotonic() - self.blind_since


def _names(hosts: list[HostSnapshot]) -> str:
    return ", ".join(clean(h.name) for h in hosts[:8]) + (", ..." if len(hosts) > 8 else "")


async def _try_grant(q: Queue, hosts: list[HostSnapshot], terms: Terms, fleet: list[str],
                     say: Callable[[str], None]) -> list[Reservation] | None:
    """One grant attempt off the event loop; a lapsed place (joined again by the loop) or
    a lock held too long (tried again next time) is not the end of the wait."""
    try:
        return await asyncio.to_thread(q.try_grant, hosts, terms, fleet)
    except LeftQueue:
        return None
    except StoreError as exc:
        say(f"could not write the grant yet ({exc}); still waiting, trying again")
        return None


async def keep_lease(q: Queue, say: Callable[[str], None], renewing: set[str],
                     poke: asyncio.Event | None = None) -> None:
    """Renew the lease every half lease, for as long as the wait lasts, and at once when
    ``poke`` is set (what the waiter sees changed: the renewal records it). A renewal
    started in time waits for the lock past the lease's end and takes the place back (see
    ``Queue.renew``), so a writer that stalls the file for less than the lease (or longer,
    if no other write dropped the place) never costs this waiter its place."""
    while True:
        until = q.lease_until
        due = 0.0 if until is None else (until - utcnow()).total_seconds() - q.lease_s / 2
        if poke is None:
            await asyncio.sleep(max(due, WATCH_S))
        else:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(poke.wait(), max(due, WATCH_S))
            poke.clear()
        if not q.id or q.lease_until is None:
            continue
        left = (q.lease_until - utcnow()).total_seconds()
        renewing.add(q.id)  # while it waits for the lock, the main loop does not join again
        try:
            # Wait for the lock as long as the place can still be taken back.
            await asyncio.to_thread(q.renew, max(left, 0) + LAPSED_KEEP_S / 2,
                                    lapsed_ok=left > 0)
        except LeftQueue:
            await asyncio.sleep(WATCH_S)  # the main loop joins again
        except StoreError as exc:
            say(f"could not renew your place in the queue ({exc}); trying again")
        finally:
            renewing.clear()


async def run_to_end(cleanup: Coroutine[Any, Any, None]) -> None:
    """Run ``cleanup`` to its end, on its own task, however often this one is cancelled
    meanwhile. An MCP client that abandons ``wait_for_gpus`` has the SDK cancel the
    handler's anyio scope, which cancels it again at every await until it returns: a
    cleanup awaited in place stopped at its first await (a join still on its thread), and
    the place stayed in the queue until its lease ran out."""
    task = asyncio.ensure_future(cleanup)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    task.result()  # (the cleanup's own error, or its own cancellation)
    if cancelled:  # (after the cleanup: the cancel this task was given, not swallowed)
        raise asyncio.CancelledError


def _leave(q: Queue, say: Callable[[str], None]) -> None:
    try:
        q.leave()
    except StoreError as exc:
        say(f"could not leave the queue ({exc}); your place lapses when its lease ends")


def _ahead(state: StoreState, q: Queue, now: object) -> str:
    from datetime import datetime

    assert isinstance(now, datetime)
    queue = state.waiting(now)
    at = next(i for i, w in enumerate(queue) if w.id == q.id)
    if at == 0:
        return "you are next; waiting for enough GPUs to be free"
    head = queue[0]
    what = (f"a {head.share_mib / 1024:g}G share" if head.share_mib
            else f"{head.count} GPU(s)")
    return f"{at} ahead of you (first: {clean(head.user)}, {what})"
