"""Releasing reservations whose job has ended, by whichever gputop looks.

A job-tied reservation (``gputop run``, ``reserve --until-exit PID``) records its job: a
session id (``run``: the remote shell that execs the command leads its own session, so
every process the job starts is in it) or one pid. **Who releases it:** ``run`` itself when
the job ends; otherwise any gputop that reads the file and checks the job's host — waiters
in the queue (every refresh), ``gputop run``, ``free``, ``reserve``, ``reservations`` and
``--json`` — so it is released even if ``run`` was SIGKILLed and nobody has the board open,
as soon as anyone on the team uses gputop. **Rule:** the first checker that finds no
process of the job on its host records ``gone_since``; any checker at least
``[reservations] job_grace`` later that still finds it gone releases it and records a
``job-ended`` event. "Gone": no process of the session (or the pid) whose start
time matches the recorded one, and no process of the holder's on the reservation's GPU.
A job seen again clears ``gone_since``. A host that cannot be asked changes nothing. A
reservation whose job never got a pid (``run`` stalled or killed while starting it) is
never taken for gone: the job may run. Every job-tied reservation still expires at its
``--for`` end at the latest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime

from gputop.config.load import Config
from gputop.jobs.remote import START_SLACK_S, Alive, JobHostError, alive_on, local_start
from gputop.model import HostSnapshot, iso
from gputop.reservations.filelock import StoreError
from gputop.reservations.ops import whoami
from gputop.reservations.records import Job, Reservation
from gputop.reservations.state import StoreState
from gputop.reservations.store import ReservationStore


def job_gone(r: Reservation, alive: Alive, now: datetime, grace_s: float,
             gpus: HostSnapshot | None = None, here: str | None = None) -> bool:
    assert r.job is not None
    if r.job.pid is None:
        # Not recorded yet: while its gputop run lives (stopped in the background, a
        # laptop lid closed) the job may well run. Once that run is gone (kill -9 before
        # it recorded the pid), only a process of the holder's on the GPU keeps it.
        return (here is not None and r.machine == here and runner_gone(r.job)
                and not uses_gpu(r, gpus))
    return not alive.has(r.job.pid, r.job.session, r.job.start) and not uses_gpu(r, gpus)


def runner_gone(job: Job) -> bool:
    """Whether the local ``gputop run`` that started ``job`` has ended (its pid is gone,
    or is another process now). Unknown (no runner recorded): not gone."""
    if job.runner is None:
        return False
    start = local_start(job.runner)
    if start is None:
        return True
    return job.runner_start is not None and abs(
        (start - job.runner_start).total_seconds()) > START_SLACK_S


def uses_gpu(r: Reservation, host: HostSnapshot | None) -> bool:
    """Whether a process of the holder (or of an owner nobody could tell) is on the
    reservation's GPU: a child that left the job's session (``setsid``, a daemon) still
    counts as the job while it uses the GPU. A host that did not answer: no."""
    if host is None or not host.ok:
        return False
    for g in host.gpus:
        if g.index == r.gpu and (r.uuid is None or g.uuid is None or g.uuid == r.uuid):
            procs = g.processes if r.instance is None else tuple(
                p for p in g.processes if p.gpu_instance_id in (None, r.instance))
            return any(p.user is None or r.is_holder(p.user) for p in procs)
    return False


async def gpus_on(config: Config, names: Sequence[str]) -> dict[str, HostSnapshot]:
    """One look at these hosts' GPUs (who runs what on them), by query: no stream is
    started for a single look."""
    from gputop.poller import Poller

    cfg = replace(config.with_defaults(collection="query"),
                  hosts=tuple(h for h in config.hosts if h.name in names))
    poller = Poller(cfg)
    try:
        return {h.name: h for h in (await poller.snapshot()).hosts}
    finally:
        await poller.aclose()


async def check_jobs(config: Config, store: ReservationStore) -> list[Reservation]:
    """Check the hosts of job-tied reservations once; returns the ones released."""
    try:
        state = store.read()
    except StoreError:
        return []
    # Only the holder's own gputop decides (apply_checks): ask only the hosts of your own
    # jobs (a teammate's job on a hung host made everyone's commands wait its timeout).
    me = whoami(store)[0]
    jobs = [r for r in state.active() if r.job is not None and r.user == me]
    if not jobs:
        return []
    hosts = {h.name: h for h in config.hosts}
    names = sorted({r.host for r in jobs if r.host in hosts})

    async def ask(name: str) -> Alive | None:
        try:
            return await alive_on(config, hosts[name])
        except JobHostError:
            return None

    answers, gpus = await asyncio.gather(
        asyncio.gather(*(ask(n) for n in names)), gpus_on(config, names))
    return await asyncio.to_thread(apply_checks, store, dict(zip(names, answers)),
                                   config.reservations.job_grace_s, gpus)


def apply_checks(store: ReservationStore, answers: dict[str, Alive | None],
                 grace_s: float, gpus: dict[str, HostSnapshot] | None = None
                 ) -> list[Reservation]:
    """Record what the hosts said, under the lock, against the file as it is now."""
    released: list[Reservation] = []
    me, here = whoami(store)

    def change(state: StoreState, now: datetime) -> StoreState:
        released.clear()
        keep: list[Reservation] = []
        events = list(state.events)
        for r in state.reservations:
            alive = answers.get(r.host)
            # Only the holder's own gputop decides that a job ended: another user's config
            # may map the host name anywhere (a machine of theirs, local = true) and see no
            # such process there.
            if r.job is None or alive is None or not r.active(now) or r.user != me:
                keep.append(r)
                continue
            if not job_gone(r, alive, now, grace_s, (gpus or {}).get(r.host), here):
                keep.append(replace(r, job=replace(r.job, gone_since=None))
                            if r.job.gone_since else r)
            elif r.job.gone_since is None:
                keep.append(replace(r, job=replace(r.job, gone_since=now)))
            elif (now - (r.job.gone_since or now)).total_seconds() >= grace_s:
                released.append(r)
                events.append({"time": iso(now), "action": "job-ended", "by": me,
                               "machine": here, "reservation": r.to_dict()})
            else:
                keep.append(r)
        return replace(state, reservations=tuple(keep), events=tuple(events))

    try:
        store.update(change)
    except StoreError:
        return []
    return list(released)


def release_ids(store: ReservationStore, ids: set[str]) -> list[Reservation]:
    """``run``'s own release when its job ended: exactly its reservations, by id."""
    gone: list[Reservation] = []

    def change(state: StoreState, now: datetime) -> StoreState:
        gone[:] = [r for r in state.reservations if r.id in ids]
        return replace(state, reservations=tuple(r for r in state.reservations
                                                 if r.id not in ids))

    store.update(change)
    return gone
