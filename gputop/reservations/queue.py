"""The fleet-wide wait queue: first come, first served, kept in the reservations file.

Waiters live in the same file as the reservations, under the same lock and the same atomic
write, so a grant is one write: the waiter leaves the queue and all of its GPUs become its
reservations together (never some of them). Each waiter holds a lease it renews while it
runs; a waiter that dies (SIGKILL, a closed laptop, a lost SSH session) drops out when its
lease ends, and Ctrl-C leaves at once.

**Order rule.** Waiters are served in the order they joined. A later waiter (or anyone
taking a GPU by hand) may be granted before one ahead of it only what cannot delay it
(``in_the_way``), so going first can never delay anyone ahead: GPUs no waiter ahead could
use, and, by backfill (:mod:`gputop.reservations.backfill`), GPUs a waiter ahead could use
but would not be given at its turn (the earliest time enough GPUs for it are free, from
the ends of reservations), or would be given but are taken only until before that turn.
A waiter whose turn is now, or cannot be told (it needs GPUs busy without a reservation),
keeps every GPU it could use. **"Could use"** (``could_use``): the GPU is on a host
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
host when hosts have 2, more memory than any GPU has), or more GPUs than the known GPUs of
its hosts (``ceiling``: a host that did not answer has none known), is refused before it
joins (``unsatisfiable``); a waiter whose request becomes unsatisfiable later (hosts changed)
blocks nobody (no GPU is one it could use) and leaves the queue itself.

The rule's tests named above are methods of :class:`~gputop.reservations.order.QueueView`,
built once per decision.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta

from gputop.model import GpuInfo, HostSnapshot, iso
from gputop.reservations.ops import Invalid, Refused, local_time, size_text, whoami
from gputop.reservations.order import QueueView as QueueView
from gputop.reservations.order import pick as pick
from gputop.reservations.order import request_of as request_of
from gputop.reservations.records import LAPSED_KEEP_S, Reservation, Waiter
from gputop.reservations.requests import Request as Request
from gputop.reservations.requests import capacity as capacity
from gputop.reservations.requests import ceiling as ceiling
from gputop.reservations.requests import unsatisfiable as unsatisfiable
from gputop.reservations.shares import (
    check_share,
)
from gputop.reservations.state import StoreState, kept
from gputop.reservations.store import ReservationStore
from gputop.reservations.terms import Target, Terms, new_reservation
from gputop.text import clean, excerpt

#: Default lease: a waiter that stops renewing leaves the queue this long after.
DEFAULT_LEASE_S = 30.0
#: Bounds on what one waiter may put into the shared file.
MAX_PLACES_PER_USER = 4
MAX_WAITER_HOSTS = 64


def queue_claim(targets: Sequence[Target], snaps: Mapping[str, HostSnapshot],
                fleet: Collection[str] | None, me: str, *, skip: bool = False,
                seconds: float | None = None) -> Callable[[StoreState, datetime], list[str]]:
    """The queue's claim on a direct reservation for ``seconds`` (None: for good), checked
    under the lock: a GPU whose taking could keep a waiter (not you) waiting longer is
    theirs to wait for (``reserve`` comes after every waiter; see :func:`in_the_way`), and
    is refused naming that waiter; with ``skip`` (``--skip-queue``) it is reserved anyway
    and the check returns the targets that skipped someone (each recorded). A GPU you
    already hold is yours to keep until its end; holding it longer is judged as taking it
    anew (a short reservation extended past a waiter's turn would skip the queue)."""
    hosts = list(snaps.values())

    def gpu_of(t: Target) -> GpuInfo | None:
        h = snaps.get(t.host)
        return next((g for g in h.gpus if g.index == t.gpu), None) if h and h.ok else None

    def check(state: StoreState, now: datetime) -> list[str]:
        skipped: list[str] = []
        view = QueueView(state, hosts, now, fleet, me)
        if not view.others:
            return skipped
        end = None if seconds is None else now + timedelta(seconds=seconds)
        held: dict[tuple[str, int], datetime] = {}
        for r in state.active(now):
            if r.user == me:
                key, ends = (r.host, r.gpu), state.ends(r, now)
                held[key] = max(held.get(key, ends), ends)
        for t in targets:
            if end is not None and (t.host, t.gpu) in held and end <= held[(t.host, t.gpu)]:
                continue  # no longer than you hold it now: nobody waits longer for it
            g = gpu_of(t)
            found = view.claimant(t.host, g, end)
            if found is None:
                continue
            w, turn_of = found
            if skip:
                skipped.append(t.label)
                continue
            waiting = len(view.others)
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
                + (f", {excerpt(w.want, 60)}" if w.want else "") + ")"
                + (f"; their turn comes {local_time(turn_of.at)} at the earliest, and a "
                   "reservation that ends before then (a shorter --for) is granted"
                   if turn_of.at is not None and turn_of.at > now else "")
                + f". {how}; that is "
                "recorded in the file with your name" + (")" if t.instance is None
                                                          else ""))
        return skipped

    return check


def share_claim(fleet: Collection[str] | None, hosts: Sequence[HostSnapshot], share_mib: int,
                me: str, t: Target, *, skip: bool = False
                ) -> Callable[[StoreState, datetime], list[str]]:
    """The order rule for a share taken by hand (``reserve --share``, the board's ``r``),
    checked under the lock: a share that would keep a waiter ahead (not you) waiting
    longer is refused, naming them; with ``skip`` (``--skip-queue``) it is taken anyway and
    the check returns its target, to be recorded (empty when it skipped nobody)."""

    def check(state: StoreState, now: datetime) -> list[str]:
        view = QueueView(state, hosts, now, fleet, me)
        queue = view.others
        if not queue:
            return []
        w = view.share_taken(queue, t.host, t.gpu, share_mib)
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

    def try_grant(self, hosts: Sequence[HostSnapshot], terms: Terms,
                  fleet: Collection[str] | None = None) -> list[Reservation] | None:
        """If the order rule lets this waiter have its GPUs now, reserve all of them on
        ``terms`` (for this waiter, with its logins) and leave the queue in one write;
        else None (nothing written). ``LeftQueue`` if its place lapsed."""
        terms = replace(terms, user=self.user, machine=self.machine,
                        login=terms.login or self.login)
        made = _grant(self.store, self.id, self.req, hosts, terms, fleet)
        if made is not None:
            self.id = ""
        return made


def reserve_now(store: ReservationStore, req: Request, hosts: Sequence[HostSnapshot],
                terms: Terms, fleet: Collection[str] | None = None
                ) -> list[Reservation] | None:
    """Reserve ``req`` at once on ``terms`` without queueing, behind every waiter (the
    order rule): None if not enough GPUs are free that no waiter could use."""
    me, here = whoami(store)
    terms = replace(terms, user=terms.user or me, machine=terms.machine or here)
    return _grant(store, None, req, hosts, terms, fleet)


def _grant(store: ReservationStore, waiter_id: str | None, req: Request,
           hosts: Sequence[HostSnapshot], terms: Terms, fleet: Collection[str] | None
           ) -> list[Reservation] | None:
    """One write: every GPU reserved and the waiter (``waiter_id``; None: someone not in
    the queue) out of the queue, or nothing. A share is one GPU, checked again under the
    lock as a share taken by hand is."""
    made: list[Reservation] = []
    if req.share_mib:
        terms = replace(terms, share_mib=req.share_mib)

    def change(state: StoreState, now: datetime) -> StoreState:
        made.clear()
        if waiter_id is not None and not any(w.id == waiter_id for w in state.waiting(now)):
            raise LeftQueue("your place in the queue lapsed (the lease was not renewed "
                            "in time)")
        got = QueueView(state, hosts, now, fleet).grantable(waiter_id, req, terms.seconds)
        if got is None:
            raise _NotYet
        ids = {r.id for r in state.reservations}
        for f in got:
            t = Target(f.host, f.gpu.index or 0, f.gpu.uuid)
            if req.share_mib:
                check_share(state, t, req.share_mib, f.gpu.memory_total_mib or 0,
                            terms.user, now)
            elif state.overlapping(t.host, t.gpu, None, now) or state.aliased(
                    t.host, t.uuid, None, now):
                raise Refused(f"{f.host}:{f.gpu.index} was reserved meanwhile")
            made.append(new_reservation(t, terms, now, ids))
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
