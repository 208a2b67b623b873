"""The fleet-wide wait queue: first come, first served, kept in the reservations file.

Waiters live in the same file as the reservations, under the same lock and the same atomic
write, so a grant is one write: the waiter leaves the queue and all of its GPUs become its
reservations together (never some of them). Each waiter holds a lease it renews while it
runs; a waiter that dies (SIGKILL, a closed laptop, a lost SSH session) drops out when its
lease ends, and Ctrl-C leaves at once.

**Order rule.** Waiters are served in the order they joined. A later waiter may be granted
before one ahead of it only with GPUs that *no* waiter ahead of it could use, so going first
can never delay anyone ahead. A GPU any earlier waiter could use waits for that waiter, even
while that waiter still needs more. **"Could use"** (``could_use``): the GPU is on a host
the waiter accepts (its ``--host``/``--tag``), has the free memory it asks for, and its host
could ever meet the whole request: for a one-host request (``gputop run``) the host has at
least the request's count of GPUs whose total memory meets the need; for a request that may
span hosts, its hosts together have that many, counting only hosts that answered: a host
that did not (or that this gputop does not poll) is no room, so a request nobody can see
being met holds no GPU back (it still waits, patiently: see ``unsatisfiable``).

**Unsatisfiable requests.** A request that no host it accepts could ever meet (3 GPUs on one
host when hosts have 2, more memory than any GPU has) is refused before it joins
(``unsatisfiable``); a waiter whose request becomes unsatisfiable later (hosts changed)
blocks nobody (no GPU is one it could use) and leaves the queue itself.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from gputop.model import GpuInfo, HostSnapshot, iso
from gputop.reservations.flags import FreeGpu, free_gpus
from gputop.reservations.ops import Invalid, Refused, Target, whoami
from gputop.reservations.store import (
    LAPSED_KEEP_S,
    Job,
    Reservation,
    ReservationStore,
    StoreState,
    Waiter,
    new_reservation,
)
from gputop.text import clean

#: Default lease: a waiter that stops renewing leaves the queue this long after.
DEFAULT_LEASE_S = 30.0
#: Bounds on what one waiter may put into the shared file.
MAX_PLACES_PER_USER = 4
MAX_WAITER_HOSTS = 64


@dataclass(frozen=True)
class Request:
    """What a waiter asks for: ``count`` GPUs with ``min_free_mib`` free, on ``hosts``
    (empty: any), all on one host if ``one_host``."""

    count: int
    min_free_mib: int = 0
    hosts: tuple[str, ...] = ()
    one_host: bool = False
    want: str = ""

    def fits(self, f: FreeGpu) -> bool:
        return self.accepts(f.host) and f.free_mib >= self.min_free_mib

    def accepts(self, host: str) -> bool:
        return not self.hosts or host in self.hosts

    def sized(self, g: GpuInfo) -> bool:
        """Whether this GPU, empty, would have the memory asked for (unknown total: yes)."""
        return (g.index is not None and not g.lost
                and (g.memory_total_mib is None or g.memory_total_mib >= self.min_free_mib))


def capacity(req: Request, hosts: Iterable[HostSnapshot], fleet: Collection[str] | None,
             *, known_only: bool = False) -> tuple[set[str], bool]:
    """The hosts on which ``req`` could ever be met (see the order rule), and whether that
    is known for sure: every host it accepts (``req.hosts``, else ``fleet``) answered.
    ``known_only``: hosts that did not answer (or that this gputop does not know) count
    as no GPUs, not as room for anything: a waiter never holds GPUs back on the strength
    of capacity nobody here can see (a request for 50 GPUs naming an unreachable host
    would otherwise block every GPU it accepts, for good)."""
    seen = {h.name: sum(1 for g in h.gpus if req.sized(g))
            for h in hosts if h.ok and req.accepts(h.name)}
    accepted = set(req.hosts) if req.hosts else (set(fleet) if fleet is not None else None)
    complete = accepted is not None and accepted <= set(seen)
    if req.one_host:
        return {h for h, n in seen.items() if n >= req.count}, complete
    if sum(seen.values()) >= req.count or not (complete or known_only):
        return {h for h, n in seen.items() if n}, complete
    return set(), complete


def unsatisfiable(req: Request, hosts: Sequence[HostSnapshot],
                  fleet: Collection[str] | None) -> str | None:
    """Why no host ``req`` accepts could ever meet it, as far as the hosts that answered
    show (every host it accepts must have answered); None if it can be met or one of its
    hosts did not answer."""
    usable, complete = capacity(req, hosts, fleet)
    if usable or not complete:
        return None
    mine = [h for h in hosts if h.ok and req.accepts(h.name)]
    if not mine:
        return "no host to wait on"
    sizes = "; ".join(_size(h) for h in mine[:8]) + ("; ..." if len(mine) > 8 else "")
    need = f"{req.count} GPU(s)" + (f" with {req.min_free_mib / 1024:g}G free"
                                     if req.min_free_mib else "")
    where = "on one host" if req.one_host else "in all"
    return f"no host can ever give {need} {where} ({sizes})"


def _size(h: HostSnapshot) -> str:
    gpus = [g for g in h.gpus if g.index is not None and not g.lost]
    big = max((g.memory_total_mib or 0 for g in gpus), default=0)
    return f"{h.name} has {len(gpus)}" + (f", the largest {big / 1024:.3g}G" if big else "")


def could_use(reqs: Sequence[Request], hosts: Sequence[HostSnapshot],
              fleet: Collection[str] | None) -> Callable[[FreeGpu], bool]:
    """Whether any of ``reqs`` could use a GPU (the order rule's test), judged on the hosts
    that answered (see :func:`capacity`'s ``known_only``)."""
    usable = [(r, capacity(r, hosts, fleet, known_only=True)[0]) for r in reqs]
    return lambda f: any(f.host in on and r.fits(f) for r, on in usable)


def request_of(w: Waiter) -> Request:
    return Request(w.count, w.min_free_mib, w.hosts, w.one_host, w.want)


def pick(req: Request, free: Sequence[FreeGpu]) -> list[FreeGpu] | None:
    """``req.count`` of ``free`` (best first), all on one host if asked; None if not enough."""
    fit = [f for f in free if req.fits(f)]
    if not req.one_host:
        return fit[: req.count] if len(fit) >= req.count else None
    for host in dict.fromkeys(f.host for f in fit):
        on = [f for f in fit if f.host == host]
        if len(on) >= req.count:
            return on[: req.count]
    return None


def grantable(state: StoreState, waiter_id: str | None, hosts: Sequence[HostSnapshot],
              now: datetime, req: Request | None = None,
              fleet: Collection[str] | None = None) -> list[FreeGpu] | None:
    """The GPUs the order rule lets this waiter take now, or None (not its turn, or not
    enough). ``waiter_id`` None with ``req``: someone not in the queue (``free --reserve``,
    ``run`` without ``--wait``), who comes after every waiter. Only unreserved GPUs count:
    nobody's reservation is ever taken or extended. ``fleet``: every host name this gputop
    knows (a waiter that accepts any host is judged against all of them)."""
    queue = state.waiting(now)
    if waiter_id is None:
        assert req is not None
        at = len(queue)
    else:
        found = next((i for i, w in enumerate(queue) if w.id == waiter_id), None)
        if found is None:
            return None
        at, req = found, request_of(queue[found])
    return pick(req, usable_now(state, hosts, now, queue[:at], fleet))


def usable_now(state: StoreState, hosts: Sequence[HostSnapshot], now: datetime,
               ahead: Sequence[Waiter], fleet: Collection[str] | None = None
               ) -> list[FreeGpu]:
    """Free, unreserved whole GPUs that none of ``ahead`` could use (the order rule). The
    queue hands out whole GPUs: a MIG instance is reserved by name (``reserve``)."""
    taken = could_use([request_of(w) for w in ahead], hosts, fleet)
    return [f for f in free_gpus(hosts, state, 0, now, user=None)
            if f.instance is None and not taken(f)]


#: The audit event of a waiter taken out of the queue by ``release --waiter``.
REMOVED = "queue-remove"


def remove_waiter(store: ReservationStore, wid: str, *, force: bool = False,
                  user: str | None = None) -> Waiter:
    """Take waiter ``wid`` out of the queue (``release --waiter``): your own place (a stale
    one from a closed laptop, say), or with ``force`` anyone's. Either way a
    ``queue-remove`` event is recorded, so that a waiter still running learns who removed
    it and stops instead of joining again."""
    me, here = whoami(store)
    me = user or me
    gone: list[Waiter] = []

    def change(state: StoreState, now: datetime) -> StoreState:
        w = next((w for w in state.queue if w.id == wid), None)
        if w is None:
            raise Refused(f"no waiter {wid!r} in the queue (it may have left or been served "
                          "already; gputop reservations lists the queue with ids)")
        if w.user != me and not force:
            raise Refused(f"waiter {wid} is {clean(w.user)}'s; --force removes it (recorded "
                          "in the file with your name)")
        gone[:] = [w]
        ev = {"time": iso(now), "action": REMOVED, "by": me, "machine": here,
              "waiter": w.to_dict()}
        return replace(state, queue=tuple(x for x in state.queue if x.id != wid),
                       events=(*state.events, ev))

    store.update(change)
    return gone[0]


def removed_by(state: StoreState, wid: str) -> str | None:
    """Who took waiter ``wid`` out of the queue, if someone did."""
    return next((str(e["by"]) for e in reversed(state.events)
                 if e.get("action") == REMOVED and e.get("waiter", {}).get("id") == wid), None)


class LeftQueue(Exception):
    """This waiter is no longer in the queue (its lease ran out): join again."""


class Queue:
    """One waiter's view of the queue in ``store``."""

    def __init__(self, store: ReservationStore, req: Request, *, lease_s: float = DEFAULT_LEASE_S,
                 user: str | None = None, machine: str | None = None) -> None:
        if req.count < 1:
            raise Invalid("--count must be at least 1")
        self.store = store
        self.req = req
        self.lease_s = lease_s
        me, here = whoami(store)
        self.user, self.machine = user or me, machine or here
        self.id = ""
        self.lease_until: datetime | None = None

    def join(self) -> int:
        """Join at the end; returns the position (1 = head)."""
        wid = secrets.token_hex(6)
        pos = [0]

        if len(self.req.hosts) > MAX_WAITER_HOSTS:
            raise Invalid(f"{len(self.req.hosts)} hosts to wait on; at most {MAX_WAITER_HOSTS}"
                          " (name fewer with --host or a narrower --tag)")

        def change(state: StoreState, now: datetime) -> StoreState:
            # Lapsed places still in the file count too: one person cannot fill the file.
            mine = sum(1 for w in state.queue if w.user == self.user)
            if mine >= MAX_PLACES_PER_USER:
                raise Refused(f"you already wait in {mine} places in the queue (a place "
                              f"lapsed less than {LAPSED_KEEP_S:.0f}s ago counts); at most "
                              f"{MAX_PLACES_PER_USER}")
            w = Waiter(id=wid, user=self.user, machine=self.machine, count=self.req.count,
                       created=now, lease=now + timedelta(seconds=self.lease_s),
                       min_free_mib=self.req.min_free_mib, hosts=self.req.hosts,
                       want=self.req.want, one_host=self.req.one_host)
            self.lease_until = w.lease
            pos[0] = len(state.waiting(now)) + 1
            return replace(state, queue=(*state.queue, w))

        self.store.update(change)
        self.id = wid
        return pos[0]

    def position(self, state: StoreState, now: datetime) -> int | None:
        return next((i + 1 for i, w in enumerate(state.waiting(now)) if w.id == self.id), None)

    def renew_due(self, now: datetime) -> bool:
        """Renew when half the lease is gone: a write per half-lease, not per poll."""
        return (self.lease_until is None
                or (self.lease_until - now).total_seconds() < self.lease_s / 2)

    def renew(self, timeout: float | None = None, *, lapsed_ok: bool = False) -> None:
        """Push the lease on; ``timeout``: how long to wait for the lock. ``lapsed_ok``:
        the renewal started while the lease ran and only waited for another writer's
        lock; then a place that lapsed meanwhile is taken back if it is still in the file
        (no write dropped it, so nobody acted on its absence but by the rule: a lapsed
        place blocks nobody)."""
        def change(state: StoreState, now: datetime) -> StoreState:
            queue = list(state.queue)
            at = next((i for i, w in enumerate(queue) if w.id == self.id
                       and (lapsed_ok or w.lease > now)), None)
            if at is None:
                raise LeftQueue("your place in the queue lapsed (the lease was not renewed "
                                "in time)")
            queue[at] = replace(queue[at], lease=now + timedelta(seconds=self.lease_s))
            self.lease_until = queue[at].lease
            return replace(state, queue=tuple(queue))

        self.store.update(change, timeout=timeout)

    def leave(self) -> None:
        if not self.id:
            return
        self.store.update(lambda state, now: replace(
            state, queue=tuple(w for w in state.queue if w.id != self.id)))
        self.id = ""

    def try_grant(self, hosts: Sequence[HostSnapshot], *, seconds: float, note: str = "",
                  job: Callable[[str], Job | None] | None = None,
                  fleet: Collection[str] | None = None) -> list[Reservation] | None:
        """If the order rule lets this waiter have its GPUs now, reserve all of them and
        leave the queue in one write; else None (nothing written). ``job(host)`` ties the
        reservations to a job."""
        def check(state: StoreState, now: datetime) -> None:
            if self.position(state, now) is None:
                raise LeftQueue("your place in the queue lapsed (the lease was not renewed "
                                "in time)")

        made = _grant(self.store, self.id, self.req, hosts, seconds=seconds, note=note,
                      job=job, user=self.user, machine=self.machine, check=check, fleet=fleet)
        if made is not None:
            self.id = ""
        return made


def reserve_now(store: ReservationStore, req: Request, hosts: Sequence[HostSnapshot], *,
                seconds: float,
                note: str = "", job: Callable[[str], Job | None] | None = None,
                fleet: Collection[str] | None = None) -> list[Reservation] | None:
    """Reserve ``req`` at once without queueing, behind every waiter (the order rule): None
    if not enough GPUs are free that no waiter could use."""
    me, here = whoami(store)
    return _grant(store, None, req, hosts, seconds=seconds, note=note, job=job, user=me,
                  machine=here, fleet=fleet)


def _grant(store: ReservationStore, waiter_id: str | None, req: Request,
           hosts: Sequence[HostSnapshot],
           *, seconds: float, note: str, job: Callable[[str], Job | None] | None, user: str,
           machine: str, check: Callable[[StoreState, datetime], None] | None = None,
           fleet: Collection[str] | None = None) -> list[Reservation] | None:
    """One write: every GPU reserved and the waiter out of the queue, or nothing."""
    made: list[Reservation] = []

    def change(state: StoreState, now: datetime) -> StoreState:
        made.clear()
        if check is not None:
            check(state, now)
        got = grantable(state, waiter_id, hosts, now, req, fleet)
        if got is None:
            raise _NotYet
        ids = {r.id for r in state.reservations}
        for f in got:
            if state.overlapping(f.host, f.gpu.index or 0, None, now):
                raise Refused(f"{f.host}:{f.gpu.index} was reserved meanwhile")
            r = new_reservation(f.host, f.gpu.index or 0, user, machine, now, seconds,
                                f.gpu.uuid, note)
            while r.id in ids:
                r = new_reservation(f.host, f.gpu.index or 0, user, machine, now, seconds,
                                    f.gpu.uuid, note)
            ids.add(r.id)
            made.append(replace(r, job=job(f.host) if job else None))
        return replace(state, reservations=state.reservations + tuple(made),
                       queue=tuple(w for w in state.queue if w.id != waiter_id))

    try:
        store.update(change)
    except _NotYet:
        return None
    return list(made)


class _NotYet(Exception):
    """Not this waiter's turn: nothing is written."""


def targets_of(rs: Sequence[Reservation]) -> list[Target]:
    return [Target(r.host, r.gpu, r.uuid) for r in rs]
