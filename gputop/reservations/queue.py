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
being met holds no GPU back (it still waits, patiently: see ``unsatisfiable``). Each waiter
records where it can be granted as its own gputop sees it (``Waiter.sees``), and every
reader judges it by that (``grantable_on``): configs and reach differ between teammates,
and a waiter that cannot reach a host must not block GPUs there. **One rule for every
path** that takes a GPU by hand (``claimant``, ``queue_claim``): ``reserve HOST:GPU``,
``free --reserve``, ``run`` and the board's ``r``.

**Shares.** A waiter may wait for a memory share of one GPU (``share_mib``) instead of
whole GPUs, under the same rule. It could use a GPU that is untouched (free, held by
nobody) with that much memory, or one already shared with that much left unshared; it is
granted the best fit (``shares.best_fit``: an already shared GPU first). A whole-GPU
waiter can never use a shared GPU; a share taken of a GPU spoils it for a waiter ahead
only if that waiter could use it now and would no longer fit after it (``share_taken``).

**Unsatisfiable requests.** A request that no host it accepts could ever meet (3 GPUs on one
host when hosts have 2, more memory than any GPU has) is refused before it joins
(``unsatisfiable``); a waiter whose request becomes unsatisfiable later (hosts changed)
blocks nobody (no GPU is one it could use) and leaves the queue itself.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from gputop.model import GpuInfo, HostSnapshot, iso
from gputop.reservations.flags import FreeGpu, free_gpus, share_fits
from gputop.reservations.ops import Invalid, Refused, Target, local_time, size_text, whoami
from gputop.reservations.records import LAPSED_KEEP_S, Job, Reservation, Waiter
from gputop.reservations.shares import ShareFit, check_share, mig_mode, room_mib, shares_of
from gputop.reservations.state import StoreState, kept
from gputop.reservations.store import ReservationStore, new_reservation
from gputop.text import clean, excerpt

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
    #: A memory share of one GPU (MiB), not whole GPUs (0).
    share_mib: int = 0

    def fits(self, f: FreeGpu) -> bool:
        if self.share_mib and (f.instance is not None or mig_mode(f.gpu)):
            return False
        return self.accepts(f.host) and f.free_mib >= max(self.min_free_mib, self.share_mib)

    def accepts(self, host: str) -> bool:
        return not self.hosts or host in self.hosts

    def sized(self, g: GpuInfo) -> bool:
        """Whether this GPU, empty, would have the memory asked for (unknown total: yes;
        a share: never a MIG GPU, and the total must be known)."""
        if self.share_mib and (mig_mode(g) or g.memory_total_mib is None):
            return False
        need = max(self.min_free_mib, self.share_mib)
        return (g.index is not None and not g.lost
                and (g.memory_total_mib is None or g.memory_total_mib >= need))


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
    need = (f"a {req.share_mib / 1024:g}G share of a GPU" if req.share_mib else
            f"{req.count} GPU(s)") + (f" with {req.min_free_mib / 1024:g}G free"
                                      if req.min_free_mib else "")
    where = "on one host" if req.one_host else "in all"
    return f"no host can ever give {need} {where} ({sizes})"


def _size(h: HostSnapshot) -> str:
    gpus = [g for g in h.gpus if g.index is not None and not g.lost]
    big = max((g.memory_total_mib or 0 for g in gpus), default=0)
    return f"{h.name} has {len(gpus)}" + (f", the largest {big / 1024:.3g}G" if big else "")


def grantable_on(w: Waiter, hosts: Sequence[HostSnapshot],
                 fleet: Collection[str] | None) -> set[str]:
    """The hosts on which waiter ``w`` could be granted: what its own gputop sees and
    recorded (``sees``: every reader's config and reach differ, so a waiter that cannot
    reach a host, or does not know it, blocks nothing there), else, for an older gputop's
    waiter, judged on the reader's hosts that answered (see :func:`capacity`)."""
    req = request_of(w)
    if w.sees is None:
        return capacity(req, hosts, fleet, known_only=True)[0]
    on = {h for h in w.sees if req.accepts(h)}
    # What the reader knows for sure still counts: a host it saw answer with too few GPUs
    # for a one-host request, or all of them together too few, is not where that request
    # can be met, whatever a (forged) place says.
    seen = {h.name: sum(1 for g in h.gpus if req.sized(g))
            for h in hosts if h.ok and h.name in on}
    if req.one_host:
        return {h for h in on if seen.get(h, req.count) >= req.count}
    if set(seen) == on and sum(seen.values()) < req.count:
        return set()
    return {h for h in on if seen.get(h, 1) > 0}


def could_use(waiters: Sequence[Waiter], hosts: Sequence[HostSnapshot],
              fleet: Collection[str] | None) -> Callable[[FreeGpu], bool]:
    """Whether any of ``waiters`` could use a GPU (the order rule's test): it is on a host
    the waiter can be granted on (:func:`grantable_on`) and has the memory it asks for."""
    usable = [(request_of(w), grantable_on(w, hosts, fleet)) for w in waiters]
    return lambda f: any(f.host in on and r.fits(f) for r, on in usable)


def claimant(state: StoreState, now: datetime, host: str, gpu: GpuInfo | None,
             hosts: Sequence[HostSnapshot], fleet: Collection[str] | None,
             me: str) -> Waiter | None:
    """The order rule for one GPU taken by hand (``reserve HOST:GPU``, ``free --reserve``,
    ``run``, the board's ``r``): the first waiter (not ``me``) who could use it, judged as
    if it were empty (reserving a busy GPU still keeps it from the waiter once it frees).
    ``gpu`` None: its host did not answer, so it is anyone's who can be granted there."""
    for w in state.waiting(now):
        if w.user == me:
            continue
        if gpu is None:
            if (host in w.sees if w.sees is not None else request_of(w).accepts(host)):
                return w
            continue
        empty = FreeGpu(host, replace(gpu, memory_used_mib=0, processes=()))
        if could_use([w], hosts, fleet)(empty):
            return w
    return None


def queue_claim(targets: Sequence[Target], snaps: Mapping[str, HostSnapshot],
                fleet: Collection[str] | None, me: str, *, skip: bool = False
                ) -> Callable[[StoreState, datetime], list[str]]:
    """The queue's claim on a direct reservation, checked under the lock: a GPU a waiter
    (not you) could use is theirs to wait for (``reserve`` comes after every waiter), and
    is refused naming that waiter; with ``skip`` (``--skip-queue``) it is reserved anyway
    and the check returns the targets that skipped someone (each recorded). A GPU you
    already hold is yours to extend."""
    hosts = list(snaps.values())

    def gpu_of(t: Target) -> GpuInfo | None:
        h = snaps.get(t.host)
        return next((g for g in h.gpus if g.index == t.gpu), None) if h and h.ok else None

    def check(state: StoreState, now: datetime) -> list[str]:
        skipped: list[str] = []
        if not any(w.user != me for w in state.waiting(now)):
            return skipped
        mine = {(r.host, r.gpu) for r in state.active(now) if r.user == me}
        for t in targets:
            if (t.host, t.gpu) in mine:
                continue
            g = gpu_of(t)
            w = claimant(state, now, t.host, g, hosts, fleet, me)
            if w is None:
                continue
            if skip:
                skipped.append(t.label)
                continue
            waiting = sum(1 for x in state.waiting(now) if x.user != me)
            how = ("the queue hands out whole GPUs: --skip-queue reserves the instance "
                   "anyway" if t.instance is not None else
                   f"Join the queue: gputop free --wait --host {clean(t.host)} (or "
                   "--skip-queue to reserve it anyway")
            raise Refused(reason="queue", message=
                f"{clean(t.label)} is one the queue waits for"
                + (f" ({clean(t.host)} did not answer, so it cannot be checked)"
                   if g is None else "")
                + f": {waiting} waiting, first who could use it: {clean(w.user)} "
                f"(since {local_time(w.created)}, for {w.count} GPU(s)"
                + (f", {excerpt(w.want, 60)}" if w.want else "") + f"). {how}; that is "
                "recorded in the file with your name" + (")" if t.instance is None
                                                          else ""))
        return skipped

    return check


def request_of(w: Waiter) -> Request:
    return Request(w.count, w.min_free_mib, w.hosts, w.one_host, w.want, w.share_mib)


def share_claim(fleet: Collection[str] | None, hosts: Sequence[HostSnapshot], share_mib: int,
                me: str, t: Target, *, skip: bool = False
                ) -> Callable[[StoreState, datetime], list[str]]:
    """The order rule for a share taken by hand (``reserve --share``, the board's ``r``),
    checked under the lock: a share that would keep a waiter ahead (not you) waiting
    longer is refused, naming them; with ``skip`` (``--skip-queue``) it is taken anyway and
    the check returns its target, to be recorded (empty when it skipped nobody)."""

    def check(state: StoreState, now: datetime) -> list[str]:
        queue = [w for w in state.waiting(now) if w.user != me]
        if not queue:
            return []
        w = share_taken(state, queue, hosts, fleet, t.host, t.gpu, share_mib, now)
        if w is None:
            return []
        if skip:
            return [t.label]
        raise Refused(reason="queue", message=
            f"{clean(t.label)} is one the queue waits for: {len(queue)} waiting, first who "
            f"could use it: {clean(w.user)} (since {local_time(w.created)}, for "
            + (f"a {size_text(w.share_mib)} share" if w.share_mib else f"{w.count} GPU(s)")
            + (f", {excerpt(w.want, 60)}" if w.want else "") + "). Join the queue: gputop "
            f"free --share {size_text(share_mib)} --wait (or --skip-queue to take it anyway;"
            " that is recorded in the file with your name)")

    return check


def share_taken(state: StoreState, ahead: Sequence[Waiter], hosts: Sequence[HostSnapshot],
                fleet: Collection[str] | None, host: str, gpu: int, share_mib: int,
                now: datetime) -> Waiter | None:
    """The first of ``ahead`` whose claim a share of ``share_mib`` of ``host:gpu`` would
    spoil (the order rule, for shares): a whole-GPU waiter who could use the GPU if it
    stays untouched, or a share waiter who could use it now and would no longer fit
    after it. None: the share keeps nobody ahead waiting longer."""
    h = next((h for h in hosts if h.name == host and h.ok), None)
    g = next((g for g in h.gpus if g.index == gpu), None) if h is not None else None
    if g is None or g.memory_total_mib is None:
        # Not seen: judged as the queue judges an unchecked GPU (anyone's who waits there)
        return next((w for w in ahead if request_of(w).accepts(host)), None)
    shares = shares_of(state, host, gpu, now)
    room = room_mib(g.memory_total_mib, shares)
    empty = FreeGpu(host, replace(g, memory_used_mib=0, processes=()))
    for w in ahead:
        req = request_of(w)
        if not req.accepts(host):
            continue
        if not req.share_mib:
            if not shares and could_use([w], hosts, fleet)(empty):
                return w
            continue
        if any(r.user == w.user for r in shares):
            continue  # they hold one already: resized by hand, not by the queue
        if req.sized(g) and room >= req.share_mib > room - share_mib:
            return w
    return None


def share_offered(state: StoreState, hosts: Sequence[HostSnapshot], req: Request,
                  share_mib: int, me: str, fleet: Collection[str] | None, now: datetime
                  ) -> list[ShareFit]:
    """The GPUs a share of ``share_mib`` fits on now for ``me``, best fit first, on hosts
    ``req`` accepts, that no waiter could use (what ``free --share`` offers)."""
    queue = [w for w in state.waiting(now) if w.user != me]
    return [f for f in share_fits(hosts, state, share_mib, now, user=me)
            if req.accepts(f.host) and f.gpu.index is not None and (
                not queue or share_taken(state, queue, hosts, fleet, f.host, f.gpu.index,
                                         share_mib, now) is None)]


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
    user = None
    if waiter_id is None:
        assert req is not None
        at = len(queue)
    else:
        found = next((i for i, w in enumerate(queue) if w.id == waiter_id), None)
        if found is None:
            return None
        at, req, user = found, request_of(queue[found]), queue[found].user
    if req.share_mib:
        fits = share_candidates(state, hosts, now, queue[:at], req, fleet, user)
        return fits[:1] or None
    return pick(req, usable_now(state, hosts, now, queue[:at], fleet))


def share_candidates(state: StoreState, hosts: Sequence[HostSnapshot], now: datetime,
                     ahead: Sequence[Waiter], req: Request,
                     fleet: Collection[str] | None = None, user: str | None = None
                     ) -> list[FreeGpu]:
    """Where a share ``req`` may go now, best fit first, spoiling nobody ahead."""
    return [FreeGpu(f.host, f.gpu)
            for f in share_fits(hosts, state, req.share_mib, now, user=user)
            if req.accepts(f.host) and f.gpu.index is not None
            and f.gpu.memory_free_mib >= req.min_free_mib
            and share_taken(state, ahead, hosts, fleet, f.host, f.gpu.index, req.share_mib,
                            now) is None]


def usable_now(state: StoreState, hosts: Sequence[HostSnapshot], now: datetime,
               ahead: Sequence[Waiter], fleet: Collection[str] | None = None
               ) -> list[FreeGpu]:
    """Free, unreserved whole GPUs that none of ``ahead`` could use (the order rule). The
    queue hands out whole GPUs: a MIG instance is reserved by name (``reserve``)."""
    taken = could_use(ahead, hosts, fleet)
    return [f for f in free_gpus(hosts, state, 0, now, user=None)
            if f.instance is None and not taken(f)]


def offered(state: StoreState, hosts: Sequence[HostSnapshot], req: Request, me: str,
            fleet: Collection[str] | None, *, whole: bool = False) -> list[FreeGpu]:
    """What ``gputop free`` offers ``me`` now, best first (``free_gpus``' ranking): free
    GPUs and MIG instances (``whole``: GPUs only) that fit ``req`` and that no waiter
    could use, your own places aside (the order rule: without waiting you come after
    every waiter)."""
    taken = could_use([w for w in state.waiting() if w.user != me], hosts, fleet)
    return [f for f in free_gpus(hosts, state, req.min_free_mib, user=me)
            if req.fits(f) and not taken(f) and not (whole and f.instance)]


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
                 user: str | None = None, machine: str | None = None,
                 login: Callable[[str], str | None] | None = None) -> None:
        if req.count < 1:
            raise Invalid("--count must be at least 1")
        self.store = store
        self.req = req
        self.lease_s = lease_s
        me, here = whoami(store)
        self.user, self.machine = user or me, machine or here
        self.id = ""
        self.lease_until: datetime | None = None
        #: The hosts this waiter can be granted on as it sees them now (None: not known):
        #: written with every join and renewal (see ``grantable_on``).
        self.sees: tuple[str, ...] | None = None
        self.login = login

    def join(self) -> int:
        """Join at the end; returns the position (1 = head)."""
        wid = secrets.token_hex(6)
        pos = [0]

        if len(self.req.hosts) > MAX_WAITER_HOSTS:
            raise Invalid(f"{len(self.req.hosts)} hosts to wait on; at most {MAX_WAITER_HOSTS}"
                          " (name fewer with --host or a narrower --tag)")

        def change(state: StoreState, now: datetime) -> StoreState:
            # Lapsed places still in the file count too (one person cannot fill the file),
            # but not a lease further ahead than any live waiter writes: the write drops it.
            mine = sum(1 for w in state.queue if w.user == self.user and kept(w, now))
            if mine >= MAX_PLACES_PER_USER:
                raise Refused(f"you already wait in {mine} places in the queue (a place "
                              f"lapsed less than {LAPSED_KEEP_S:.0f}s ago counts); at most "
                              f"{MAX_PLACES_PER_USER}")
            w = Waiter(id=wid, user=self.user, machine=self.machine, count=self.req.count,
                       created=now, lease=now + timedelta(seconds=self.lease_s),
                       min_free_mib=self.req.min_free_mib, hosts=self.req.hosts,
                       want=self.req.want, one_host=self.req.one_host,
                       share_mib=self.req.share_mib, sees=self.sees)
            self.lease_until = w.lease
            pos[0] = len(state.waiting(now)) + 1
            return replace(state, queue=(*state.queue, w))

        # Known before the write lands: a leave that runs while this write is still under
        # way (a cancelled waiter's cleanup, on another thread) then finds the place.
        self.id = wid
        try:
            self.store.update(change)
        except BaseException:
            self.id = ""
            raise
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
            queue[at] = replace(queue[at], lease=now + timedelta(seconds=self.lease_s),
                                sees=self.sees)
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
                      job=job, user=self.user, machine=self.machine, check=check, fleet=fleet,
                      login=self.login)
        if made is not None:
            self.id = ""
        return made


def reserve_now(store: ReservationStore, req: Request, hosts: Sequence[HostSnapshot], *,
                seconds: float,
                note: str = "", job: Callable[[str], Job | None] | None = None,
                fleet: Collection[str] | None = None,
                login: Callable[[str], str | None] | None = None) -> list[Reservation] | None:
    """Reserve ``req`` at once without queueing, behind every waiter (the order rule): None
    if not enough GPUs are free that no waiter could use."""
    me, here = whoami(store)
    return _grant(store, None, req, hosts, seconds=seconds, note=note, job=job, user=me,
                  machine=here, fleet=fleet, login=login)


def _grant(store: ReservationStore, waiter_id: str | None, req: Request,
           hosts: Sequence[HostSnapshot],
           *, seconds: float, note: str, job: Callable[[str], Job | None] | None, user: str,
           machine: str, check: Callable[[StoreState, datetime], None] | None = None,
           fleet: Collection[str] | None = None,
           login: Callable[[str], str | None] | None = None) -> list[Reservation] | None:
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
        if req.share_mib:  # a share: one GPU, checked again under the lock
            share = req.share_mib
            f = got[0]
            t = Target(f.host, f.gpu.index or 0, f.gpu.uuid)
            check_share(state, t, share, f.gpu.memory_total_mib or 0, user, now)
            r = new_reservation(t.host, t.gpu, user, machine, now, seconds, t.uuid, note,
                                share_mib=share)
            while r.id in ids:
                r = new_reservation(t.host, t.gpu, user, machine, now, seconds, t.uuid,
                                    note, share_mib=share)
            made.append(replace(r, job=job(f.host) if job else None,
                                login=login(f.host) if login else None))
            return replace(state, reservations=state.reservations + tuple(made),
                           queue=tuple(w for w in state.queue if w.id != waiter_id))
        for f in got:
            if state.overlapping(f.host, f.gpu.index or 0, None, now) or state.aliased(
                    f.host, f.gpu.uuid, None, now):
                raise Refused(f"{f.host}:{f.gpu.index} was reserved meanwhile")
            r = new_reservation(f.host, f.gpu.index or 0, user, machine, now, seconds,
                                f.gpu.uuid, note)
            while r.id in ids:
                r = new_reservation(f.host, f.gpu.index or 0, user, machine, now, seconds,
                                    f.gpu.uuid, note)
            ids.add(r.id)
            made.append(replace(r, job=job(f.host) if job else None,
                                login=login(f.host) if login else None))
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
