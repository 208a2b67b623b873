"""``--share SIZE`` for ``reserve``, ``free`` and ``run``: memory shares of one GPU
(``gputop.reservations.shares``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import TextIO

from gputop.cli.targets import (
    check_hosts,
    host_config,
    nobody_answered,
    open_store,
    poll_hosts,
    queue_request,
    reap_ended_jobs,
    reservation_seconds,
    validate_gpus,
)
from gputop.config.load import Config
from gputop.errors import EXIT_NO_HOST, EXIT_OK, EXIT_REFUSED
from gputop.model import HostSnapshot, iso, utcnow
from gputop.output import write_document
from gputop.reservations.ops import Invalid, Refused, format_duration, local_time, size_text, whoami
from gputop.reservations.order import QueueView
from gputop.reservations.queue import share_claim
from gputop.reservations.records import Job, Reservation
from gputop.reservations.shares import (
    ShareFit,
    ShareOutcome,
    parse_size_mib,
    reserve_share,
    room_mib,
    share_gpu,
    shares_of,
)
from gputop.reservations.state import StoreState
from gputop.reservations.store import ReservationStore
from gputop.reservations.targets import parse_targets
from gputop.reservations.terms import Target, Terms, tied
from gputop.text import clean


def share_size(text: str) -> int:
    mib = parse_size_mib(text)
    if mib < 1:
        raise Invalid(f"--share {text}: a share must be at least 1M")
    return mib


def _left(r: Reservation) -> str:
    left = format_duration(max(0.0, (r.expires - utcnow()).total_seconds()))
    return f"until {local_time(r.expires)} ({left} left)"


def print_share(o: ShareOutcome, total_mib: int, state: StoreState, out: TextIO) -> None:
    """One line saying what happened, and what is left unshared of the GPU."""
    r = o.reservation
    gpu, size = clean(f"{r.host}:{r.gpu}"), size_text(r.share_mib or 0)
    rest = room_mib(total_mib, shares_of(state, r.host, r.gpu, utcnow()))
    tail = f"; {size_text(rest)} of {size_text(total_mib)} left unshared"
    if o.action == "reserved":
        line = f"reserved a {size} share of {gpu} {_left(r)}"
    elif o.action == "resized":
        assert o.previous is not None
        line = (f"resized your share of {gpu} from {size_text(o.previous.share_mib or 0)} "
                f"to {size} {_left(r)}")
    elif o.action == "extended":
        line = f"extended your {size} share of {gpu} {_left(r)}"
    else:
        line = f"kept your {size} share of {gpu} {_left(r)}: it already lasts longer than asked"
    print(line + tail, file=out)


def reserve_share_cmd(config: Config, args: argparse.Namespace, job: Job | None) -> int:
    """``gputop reserve HOST:GPU --share SIZE``."""
    share = share_size(args.share)
    targets = parse_targets(args.targets)
    if len(targets) != 1 or targets[0].instance is not None or targets[0].gpu < 0:
        raise Invalid("--share takes one whole GPU: HOST:GPU, e.g. gpu-01:3 --share 16G "
                      "(a MIG instance is reserved whole: its instances are the shares)")
    check_hosts(config, targets)
    seconds = reservation_seconds(config, args.duration)
    store = open_store(config)
    reap_ended_jobs(config, store)
    snaps: dict[str, HostSnapshot] = {}
    t = validate_gpus(config, targets, snaps)[0]
    g = share_gpu(snaps.get(t.host), t)
    assert g.memory_total_mib is not None
    me = whoami(open_store(config))[0]
    check = share_claim(_fleet(config), list(snaps.values()), share, me, t,
                        skip=bool(args.skip_queue))
    o = reserve_share(store, t, g.memory_total_mib, _terms(config, args, share, job, seconds),
                      check=check)
    print_share(o, g.memory_total_mib, store.read(), sys.stdout)
    if g.memory_free_mib < share:
        print(f"gputop: warning: {clean(t.label)} has {size_text(max(0, g.memory_free_mib))}"
              " free now: someone uses more than the shares leave", file=sys.stderr)
    if job is not None:
        print(f"tied to process {job.pid} on {t.host}: released once it has ended")
    return EXIT_OK


def _terms(config: Config, args: argparse.Namespace, share: int, job: Job | None,
           seconds: float) -> Terms:
    """The terms of a share asked for on the command line (``--note``), for ``seconds``."""
    from gputop.jobs.remote import logins

    return Terms(seconds, config.reservations.max_s, args.note or "", job=tied(job),
                 login=logins(config), share_mib=share)


def _fits_now(config: Config, store: ReservationStore, args: argparse.Namespace, share: int
              ) -> tuple[list[HostSnapshot], list[ShareFit]]:
    """The GPUs a share fits on now, best fit first, that no waiter could use."""
    req = queue_request(config, args, one_host=False)
    hosts = asyncio.run(poll_hosts(config, set(req.hosts) or None))
    view = QueueView(store.read(), hosts, utcnow(), _fleet(config),
                     whoami(open_store(config))[0])
    fits = view.share_offered(req, share)
    return hosts, fits


def free_share_cmd(config: Config, args: argparse.Namespace) -> int:
    """``gputop free --share SIZE [--reserve | --wait]``: best fit, one GPU."""
    share = share_size(args.share)
    if args.count != 1:
        raise Invalid("--share finds one GPU to share (--count 1); for more, ask again")
    if args.whole:
        raise Invalid("give --share or --whole, not both")
    store = open_store(config)
    reap_ended_jobs(config, store)
    if args.wait:
        got = wait_for_share(config, store, args, share, job=None)
        if got is None:
            if args.json:
                write_document({"version": 1, "reserved": False, "free": []}, sys.stdout)
            return EXIT_REFUSED
        r, total = got
        print_share(ShareOutcome("reserved", r), total, store.read(), sys.stderr)
        _print_found(args, [(r.host, r.gpu, r.uuid, r.share_mib, iso(r.expires))])
        return EXIT_OK
    hosts, fits = _fits_now(config, store, args, share)
    if not fits and (nobody := nobody_answered(hosts)):
        print(f"gputop: {nobody}", file=sys.stderr)
        if args.json:
            write_document({"version": 1, "free": []}, sys.stdout)
        return EXIT_NO_HOST
    if not fits:
        waiting = len(store.read().waiting())
        print(f"gputop: no GPU with {size_text(share)} to share found"
              + (f" ({waiting} waiting in the queue; --wait joins it)" if waiting else
                 " (--wait to queue for one)"), file=sys.stderr)
        if args.json:
            write_document({"version": 1, "free": []}, sys.stdout)
        return EXIT_REFUSED
    if not args.reserve:
        if args.json:
            write_document({"version": 1, "reserved": False, "free": [
                _fit_doc(f, share) for f in fits]}, sys.stdout)
        else:
            for f in fits:
                print(f.label)
        return EXIT_OK
    seconds = reservation_seconds(config, args.duration)
    me = whoami(open_store(config))[0]
    for f in fits:  # best first; one taken meanwhile: the next
        assert f.gpu.index is not None and f.gpu.memory_total_mib is not None
        t = Target(f.host, f.gpu.index, f.gpu.uuid)
        try:
            o = reserve_share(store, t, f.gpu.memory_total_mib,
                              _terms(config, args, share, None, seconds),
                              check=share_claim(_fleet(config), hosts, share, me, t))
        except Refused:
            continue
        print_share(o, f.gpu.memory_total_mib, store.read(), sys.stderr)
        r = o.reservation
        _print_found(args, [(r.host, r.gpu, r.uuid, r.share_mib, iso(r.expires))])
        return EXIT_OK
    print(f"gputop: every GPU with {size_text(share)} to share was taken meanwhile; ask "
          "again", file=sys.stderr)
    return EXIT_REFUSED


def _fit_doc(f: ShareFit, share: int) -> dict[str, object]:
    return {"host": f.host, "gpu": f.gpu.index, "uuid": f.gpu.uuid, "name": f.gpu.name,
            "memory_free_mib": f.gpu.memory_free_mib, "share_mib": share,
            "unshared_mib": f.room_mib, "shared": bool(f.shares)}


def _print_found(args: argparse.Namespace,
                 got: Sequence[tuple[str, int, str | None, int | None, str | None]]) -> None:
    if args.json:
        write_document({"version": 1, "reserved": True, "free": [
            {"host": h, "gpu": gpu, "uuid": uuid, "share_mib": share, "expires": exp}
            for h, gpu, uuid, share, exp in got]}, sys.stdout)
    else:
        for h, gpu, *_ in got:
            print(f"{h}:{gpu}")


def wait_for_share(config: Config, store: ReservationStore, args: argparse.Namespace, share: int,
                   job: Job | None) -> tuple[Reservation, int] | None:
    """Wait in the queue for a share (the order rule as for whole GPUs): the share and its
    GPU's total memory, or None (timed out or interrupted)."""
    from gputop.cli.waiting import wait_in_queue

    req = replace(queue_request(config, args, one_host=True), share_mib=share)
    seconds = reservation_seconds(config, args.duration) if args.duration else (
        config.reservations.max_s if job is not None else config.reservations.default_s)
    code, got = wait_in_queue(config, store, req, args, seconds=seconds, job=job)
    if code != EXIT_OK or not got:
        return None
    r = got[0]
    hosts = asyncio.run(poll_hosts(config, {r.host}))
    total = next((g.memory_total_mib for h in hosts for g in h.gpus
                  if h.ok and g.index == r.gpu), None)
    return r, total or (r.share_mib or 0)


def run_share(config: Config, args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``gputop run --share SIZE -- CMD``: a share (best fit), the job told its size, the
    share released when the job ends."""
    share = share_size(args.share)
    if args.count != 1:
        raise Invalid("--share runs on one share of one GPU (--count 1)")
    store = open_store(config)
    reap_ended_jobs(config, store)
    from gputop.jobs.remote import local_start

    # Tied to the job from the start, and to this process until the job's pid is recorded
    # (a run killed before that is released after the grace: see jobs.reap).
    pending = Job(None, session=True, runner=os.getpid(), runner_start=local_start(os.getpid()))
    seconds = (reservation_seconds(config, args.duration) if args.duration
               else config.reservations.max_s)
    r: Reservation | None = None
    total: int | None = None
    if args.wait:
        got = wait_for_share(config, store, args, share, pending)
        if got is None:
            return EXIT_REFUSED
        r, total = got
    else:
        hosts, fits = _fits_now(config, store, args, share)
        me = whoami(open_store(config))[0]
        for f in fits:
            assert f.gpu.index is not None and f.gpu.memory_total_mib is not None
            t = Target(f.host, f.gpu.index, f.gpu.uuid)
            try:
                o = reserve_share(store, t, f.gpu.memory_total_mib,
                                  _terms(config, args, share, pending, seconds),
                                  check=share_claim(_fleet(config), hosts, share, me, t))
            except Refused:
                continue
            r, total = o.reservation, f.gpu.memory_total_mib
            break
        if r is None and (nobody := nobody_answered(hosts)):
            print(f"gputop: {nobody}", file=sys.stderr)
            return EXIT_NO_HOST
        if r is None:
            print(f"gputop: no GPU with {size_text(share)} to share; --wait to queue for "
                  "one", file=sys.stderr)
            return EXIT_REFUSED
    from gputop.jobs.run import run_on, share_env

    env = share_env([r], total)
    print(f"gputop: running on a {size_text(share)} share of {clean(r.host)}:{r.gpu} ("
          + " ".join(f"{k}={v}" for k, v in env.items()) + ")", file=sys.stderr, flush=True)

    def say(msg: str) -> None:
        print(f"gputop: {msg}", file=sys.stderr, flush=True)

    return asyncio.run(run_on(config, host_config(config, r.host), store, [r], argv, say,
                              env))


def _fleet(config: Config) -> list[str]:
    return [h.name for h in config.hosts]
