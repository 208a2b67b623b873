"""The queue's order rule as one object (see :mod:`gputop.reservations.queue` for the rule).

Every decision of the rule (a grant, a GPU taken by hand, what ``free`` offers) reads the
same few things: the file's state, the hosts as they answered, the time, every host name
this gputop knows (``fleet``) and who asks (``me``). :class:`QueueView` holds them, built
once per decision, so that each test of the rule sees one moment and the backfill turns
(:mod:`gputop.reservations.backfill`) are worked out from one list of free GPUs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from functools import cached_property

from gputop.model import GpuInfo, HostSnapshot
from gputop.reservations.backfill import (
    Key,
    Turn,
    candidates,
    delays,
    free_at,
    held_after,
    sized_keys,
    turn,
)
from gputop.reservations.flags import FreeGpu, free_gpus, share_fits
from gputop.reservations.requests import Request, capacity
from gputop.reservations.shares import ShareFit, room_mib, shares_of
from gputop.reservations.store import StoreState, Waiter

#: The first waiter a GPU taken until a time could keep waiting longer, with its turn.
InTheWay = Callable[[FreeGpu, datetime | None], tuple[Waiter, Turn] | None]


def request_of(w: Waiter) -> Request:
    return Request(w.count, w.min_free_mib, w.hosts, w.one_host, w.want, w.share_mib)


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


class QueueView:
    """The order rule at ``now`` over ``state`` and ``hosts``, for ``me`` (whose own places
    never stand in their way; empty: someone with none). ``fleet``: every host name this
    gputop knows (a waiter that accepts any host is judged against all of them)."""

    def __init__(self, state: StoreState, hosts: Sequence[HostSnapshot], now: datetime,
                 fleet: Collection[str] | None = None, me: str = "") -> None:
        self.state = state
        self.hosts = list(hosts)
        self.now = now
        self.fleet = fleet
        self.me = me

    @property
    def others(self) -> list[Waiter]:
        """The live waiters who are not ``me``: everyone a GPU taken by hand comes after."""
        return [w for w in self.state.waiting(self.now) if w.user != self.me]

    @cached_property
    def free(self) -> list[FreeGpu]:
        """Free, unreserved GPUs and instances, anyone's to take (best first)."""
        return free_gpus(self.hosts, self.state, 0, self.now, user=None)

    @cached_property
    def _free_at(self) -> dict[Key, datetime]:
        return free_at(self.state, self.hosts, self.now, self.free)

    def grantable_on(self, w: Waiter) -> set[str]:
        """The hosts on which waiter ``w`` could be granted: what its own gputop sees and
        recorded (``sees``: every reader's config and reach differ, so a waiter that cannot
        reach a host, or does not know it, blocks nothing there), else, for an older
        gputop's waiter, judged on the reader's hosts that answered (see ``capacity``)."""
        req = request_of(w)
        if w.sees is None:
            return capacity(req, self.hosts, self.fleet, known_only=True)[0]
        on = {h for h in w.sees if req.accepts(h)}
        # What the reader knows for sure still counts: a host it saw answer with too few
        # GPUs for a one-host request, or all of them together too few, is not where that
        # request can be met, whatever a (forged) place says.
        seen = {h.name: sum(1 for g in h.gpus if req.sized(g))
                for h in self.hosts if h.ok and h.name in on}
        if req.one_host:
            return {h for h in on if seen.get(h, req.count) >= req.count}
        if set(seen) == on and sum(seen.values()) < req.count:
            return set()
        return {h for h in on if seen.get(h, 1) > 0}

    def could_use(self, waiters: Sequence[Waiter]) -> Callable[[FreeGpu], bool]:
        """Whether any of ``waiters`` could use a GPU (the order rule's test): it is on a
        host the waiter can be granted on (:meth:`grantable_on`) and has the memory it asks
        for."""
        usable = [(request_of(w), self.grantable_on(w)) for w in waiters]
        return lambda f: any(f.host in on and r.fits(f) for r, on in usable)

    def turns(self, ahead: Sequence[Waiter]) -> list[tuple[Waiter, Request, set[str], Turn]]:
        """Each of ``ahead`` with its request, where it can be granted, and its backfill
        turn (:func:`~gputop.reservations.backfill.turn`), in queue order: the GPUs of an
        earlier waiter's turn count as held after it for those behind. A share waiter's
        turn is not told (it keeps every GPU it could use)."""
        when = dict(self._free_at)
        gpus = candidates(self.hosts, when)
        sized: dict[int, frozenset[Key]] = {}  # by memory asked for
        plans = []
        for w in ahead:
            req, on = request_of(w), self.grantable_on(w)
            if req.share_mib:
                t = Turn(None)
            else:
                if req.min_free_mib not in sized:
                    sized[req.min_free_mib] = sized_keys(gpus, req.sized)
                t = turn(req.count, req.one_host, sized[req.min_free_mib], on, gpus, when)
            held_after(t, self.state, when)
            plans.append((w, req, on, t))
        return plans

    def in_the_way(self, ahead: Sequence[Waiter]) -> InTheWay:
        """The first of ``ahead`` that taking a GPU until a time (None: for good) could keep
        waiting longer (the order rule, with backfill), with its turn: one that could use
        the GPU and whose turn is now or cannot be told, or whose turn takes this GPU
        before that time."""
        plans = self.turns(ahead)
        now = self.now

        def first(f: FreeGpu, end: datetime | None) -> tuple[Waiter, Turn] | None:
            key = (f.host, f.gpu.index or 0)
            return next(((w, t) for w, r, on, t in plans
                         if f.host in on and r.fits(f) and delays(t, key, now, end)), None)

        return first

    def claimant(self, host: str, gpu: GpuInfo | None, end: datetime | None = None
                 ) -> tuple[Waiter, Turn] | None:
        """The order rule for one GPU taken by hand (``reserve HOST:GPU``, ``free
        --reserve``, ``run``, the board's ``r``) until ``end`` (None: for good): the first
        waiter (not ``me``) it could keep waiting longer (:meth:`in_the_way`), judged as if
        it were empty (reserving a busy GPU still keeps it from the waiter once it frees).
        ``gpu`` None: its host did not answer, so it is anyone's who can be granted there."""
        others = self.others
        if gpu is None:
            return next(((w, Turn(None)) for w in others if (
                host in w.sees if w.sees is not None else request_of(w).accepts(host))),
                None)
        empty = FreeGpu(host, replace(gpu, memory_used_mib=0, processes=()))
        return self.in_the_way(others)(empty, end)

    def share_taken(self, ahead: Sequence[Waiter], host: str, gpu: int, share_mib: int
                    ) -> Waiter | None:
        """The first of ``ahead`` whose claim a share of ``share_mib`` of ``host:gpu`` would
        spoil (the order rule, for shares): a whole-GPU waiter who could use the GPU if it
        stays untouched, or a share waiter who could use it now and would no longer fit
        after it. None: the share keeps nobody ahead waiting longer."""
        h = next((h for h in self.hosts if h.name == host and h.ok), None)
        g = next((g for g in h.gpus if g.index == gpu), None) if h is not None else None
        if g is None or g.memory_total_mib is None:
            # Not seen: judged as the queue judges an unchecked GPU (anyone's who waits there)
            return next((w for w in ahead if request_of(w).accepts(host)), None)
        shares = shares_of(self.state, host, gpu, self.now)
        room = room_mib(g.memory_total_mib, shares)
        empty = FreeGpu(host, replace(g, memory_used_mib=0, processes=()))
        for w in ahead:
            req = request_of(w)
            if not req.accepts(host):
                continue
            if not req.share_mib:
                if not shares and self.could_use([w])(empty):
                    return w
                continue
            if any(r.user == w.user for r in shares):
                continue  # they hold one already: resized by hand, not by the queue
            if req.sized(g) and room >= req.share_mib > room - share_mib:
                return w
        return None

    def share_offered(self, req: Request, share_mib: int) -> list[ShareFit]:
        """The GPUs a share of ``share_mib`` fits on now for ``me``, best fit first, on
        hosts ``req`` accepts, that no waiter could use (what ``free --share`` offers)."""
        queue = self.others
        return [f for f in share_fits(self.hosts, self.state, share_mib, self.now,
                                      user=self.me)
                if req.accepts(f.host) and f.gpu.index is not None and (
                    not queue or self.share_taken(queue, f.host, f.gpu.index, share_mib)
                    is None)]

    def grantable(self, waiter_id: str | None, req: Request | None = None,
                  seconds: float | None = None) -> list[FreeGpu] | None:
        """The GPUs the order rule lets this waiter take now for ``seconds`` (None: for
        good), or None (not its turn, or not enough). ``waiter_id`` None with ``req``:
        someone not in the queue (``free --reserve``, ``run`` without ``--wait``), who
        comes after every waiter. Only unreserved GPUs count: nobody's reservation is ever
        taken or extended."""
        queue = self.state.waiting(self.now)
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
            return self.share_candidates(queue[:at], req, user)[:1] or None
        end = None if seconds is None else self.now + timedelta(seconds=seconds)
        return pick(req, self.usable_now(queue[:at], end))

    def share_candidates(self, ahead: Sequence[Waiter], req: Request,
                         user: str | None = None) -> list[FreeGpu]:
        """Where a share ``req`` may go now, best fit first, spoiling nobody ahead."""
        return [FreeGpu(f.host, f.gpu)
                for f in share_fits(self.hosts, self.state, req.share_mib, self.now,
                                    user=user)
                if req.accepts(f.host) and f.gpu.index is not None
                and f.gpu.memory_free_mib >= req.min_free_mib
                and self.share_taken(ahead, f.host, f.gpu.index, req.share_mib) is None]

    def usable_now(self, ahead: Sequence[Waiter], end: datetime | None = None
                   ) -> list[FreeGpu]:
        """Free, unreserved whole GPUs that taking until ``end`` (None: for good) keeps none
        of ``ahead`` waiting longer (the order rule, with backfill). The queue hands out
        whole GPUs: a MIG instance is reserved by name (``reserve``)."""
        taken = self.in_the_way(ahead)
        return [f for f in self.free if f.instance is None and taken(f, end) is None]

    def offered(self, req: Request, *, whole: bool = False, seconds: float | None = None
                ) -> list[FreeGpu]:
        """What ``gputop free`` offers ``me`` now for ``seconds`` (None: for good), best
        first (``free_gpus``' ranking): free GPUs and MIG instances (``whole``: GPUs only)
        that fit ``req`` and that taking keeps no waiter waiting longer (the order rule:
        without waiting you come after every waiter), your own places aside, and your own
        reservations always (they are yours, whoever waits)."""
        taken = self.in_the_way(self.others)
        end = None if seconds is None else self.now + timedelta(seconds=seconds)
        mine = {(r.host, r.gpu) for r in self.state.active(self.now) if r.user == self.me}
        return [f for f in free_gpus(self.hosts, self.state, req.min_free_mib, self.now,
                                     user=self.me)
                if req.fits(f) and not (whole and f.instance)
                and ((f.host, f.gpu.index) in mine or taken(f, end) is None)]
