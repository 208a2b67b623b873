"""``gputop reserve``, ``release`` and ``reservations``: the shared file for scripts.

Each returns an exit code (0 done, 1 refused, 2 usage/config/store error) and prints what
a script needs on stdout, diagnostics on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import TextIO

from gputop.cli.targets import (
    check_hosts,
    host_config,
    open_store,
    reap_ended_jobs,
    reservation_seconds,
    resolve_mig,
    validate_gpus,
)
from gputop.config.load import Config
from gputop.errors import EXIT_OK
from gputop.model import HostSnapshot, iso, utcnow
from gputop.output import write_document
from gputop.reservations.ops import (
    Invalid,
    Outcome,
    Refused,
    ends_with,
    format_duration,
    local_time,
    release,
    reserve_outcomes,
    size_text,
    whoami,
)
from gputop.reservations.queue import queue_claim
from gputop.reservations.records import Job, Reservation
from gputop.reservations.targets import parse_targets
from gputop.reservations.terms import Target, Terms, tied
from gputop.text import clean, excerpt


def _until(r: Reservation) -> str:
    left = format_duration(max(0.0, (r.expires - utcnow()).total_seconds()))
    return f"until {local_time(r.expires)} ({left} left)"

def print_outcomes(made: Sequence[Outcome], out: TextIO) -> None:
    """One line per GPU saying what happened, in local time (``--json`` keeps UTC)."""
    for o in made:
        r, gpu = o.reservation, clean(o.reservation.target)
        if o.action == "reserved":
            print(f"reserved {gpu} {_until(r)}", file=out)
        elif o.action == "untied":
            assert o.previous is not None and o.previous.job is not None
            pid = o.previous.job.pid
            print(f"reserved {gpu} {_until(r)}: no longer tied to its job"
                  + (f" (pid {pid})" if pid is not None else "")
                  + "; it stays when the job ends", file=out)
        elif o.action == "extended":
            assert o.previous is not None
            print(f"extended your reservation of {gpu} {_until(r)} (was until "
                  f"{local_time(o.previous.expires)})", file=out)
        else:
            print(f"kept your reservation of {gpu} {_until(r)}: it already lasts longer "
                  "than asked" + (" (note updated)" if o.previous and o.previous.note != r.note
                                  else ""), file=out)

def cmd_reserve(config: Config, args: argparse.Namespace) -> int:
    targets = parse_targets(args.targets)
    check_hosts(config, targets)
    seconds = reservation_seconds(config, args.duration)
    job = _until_exit(config, targets, args.until_exit) if args.until_exit is not None else None
    if getattr(args, "share", None) is not None:
        from gputop.cli.shares import reserve_share_cmd

        return reserve_share_cmd(config, args, job)
    store = open_store(config)
    reap_ended_jobs(config, store)
    snaps: dict[str, HostSnapshot] = {}
    targets = validate_gpus(config, targets, snaps)
    from gputop.jobs.remote import answered_logins

    check = queue_claim(targets, snaps, [h.name for h in config.hosts], whoami(store)[0],
                        skip=args.skip_queue, seconds=seconds)
    terms = Terms(seconds, config.reservations.max_s, args.note or "", job=tied(job),
                  login=answered_logins(config, snaps))
    made = reserve_outcomes(store, targets, terms, check=check, event="skip-queue")
    print_outcomes(made, sys.stdout)
    if job is not None:
        print(f"tied to process {job.pid} on {targets[0].host}: released once it has ended",
              file=sys.stdout)
    return EXIT_OK

def cmd_extend(config: Config, args: argparse.Namespace) -> int:
    """``gputop extend HOST:GPU --for D``: more time for what you hold, never a new
    reservation (what an "ends in 15 min" notice says to run); by the same rules as
    ``reserve`` (``max_duration``, and the queue: holding longer than you do now is taking
    the GPU anew)."""
    targets = parse_targets(args.targets)
    store = open_store(config)
    me, now = whoami(store)[0], utcnow()
    held = [r for r in store.read().active(now) if r.user == me]
    whole = {(r.host, r.gpu, r.instance) for r in held if r.share_mib is None}
    for t in targets:
        if t.uuid is not None:
            raise Invalid(f"{clean(t.label)}: name it as HOST:GPU or HOST:GPU/INSTANCE")
        if (t.host, t.gpu, t.instance) in whole:
            continue
        if any((r.host, r.gpu) == (t.host, t.gpu) for r in held):
            raise Invalid(f"you hold a share of {clean(t.label)}: gputop reserve "
                          f"{clean(t.label)} --share SIZE --for {args.duration} renews it")
        raise Invalid(f"{clean(t.label)} is not yours now: extend gives more time to what "
                      "you hold (gputop reserve reserves it)")
    args.note = args.until_exit = args.share = None
    args.skip_queue = False
    return cmd_reserve(config, args)


def _until_exit(config: Config, targets: Sequence[Target], pid: int) -> Job:
    """``--until-exit PID``: the process must exist now, on the one host reserved on."""
    from gputop.jobs.remote import JobHostError, alive_on

    hosts = {t.host for t in targets}
    if len(hosts) != 1:
        raise Invalid("--until-exit ties the reservation to a process on one host; "
                      f"these GPUs are on {len(hosts)} hosts")
    if not 1 <= pid < 2**31:
        raise Invalid(f"--until-exit {pid}: not a process id")
    host = host_config(config, next(iter(hosts)))
    try:
        alive = asyncio.run(alive_on(config, host))
    except JobHostError as exc:
        raise Refused(f"cannot check process {pid} on {host.name}: {exc}") from None
    if not alive.has(pid, False):
        raise Invalid(f"--until-exit {pid}: no such process on {host.name}")
    return Job(pid, session=False, start=alive.start_of(pid))

def cmd_release(config: Config, args: argparse.Namespace) -> int:
    if args.waiter is not None:
        if args.mine or args.targets:
            raise Invalid("give --waiter ID alone (not with HOST:GPU or --mine)")
        from gputop.reservations.queue import remove_waiter

        w = remove_waiter(open_store(config), args.waiter, force=args.force)
        print(f"removed waiter {w.id} ({clean(w.user)}, for {w.count} GPU(s)"
              + (f", {excerpt(w.want, 60)}" if w.want else "") + ") from the queue")
        return EXIT_OK
    if args.mine and args.targets:
        raise Invalid("give HOST:GPU arguments or --mine, not both")
    if not args.mine and not args.targets:
        now = utcnow()
        store = open_store(config)
        me = whoami(store)[0]
        mine = sorted((r for r in store.read().active(now) if r.user == me),
                      key=lambda r: (r.host, r.gpu, r.instance or -1))
        held = ("; yours now: " + ", ".join(clean(r.target) for r in mine)
                if mine else "; you hold no reservations now")
        raise Invalid("say what to release: gputop release HOST:GPU[,GPU...] (e.g. "
                      "gputop release gpu-01:0,1), or gputop release --mine for all of yours"
                      + held)
    targets = None if args.mine else parse_targets(args.targets)
    if targets:
        check_hosts(config, targets)
        targets = resolve_mig(config, targets)
    store = open_store(config)
    gone = release(store, targets, force=args.force)
    me = whoami(store)[0]
    for r in gone:
        print(f"released {clean(r.target)}" + (f" (held by {clean(r.user)})"
                                                     if r.user != me else ""))
    if not gone:
        print("nothing to release", file=sys.stderr)
    return EXIT_OK

def cmd_reservations(config: Config, args: argparse.Namespace) -> int:
    reap_ended_jobs(config, open_store(config))
    state = open_store(config).read()
    now = utcnow()
    active = sorted(state.active(now), key=lambda r: (r.host, r.gpu, r.instance or -1))
    queue = state.waiting(now)
    lapsed = state.lapsed(now)
    if args.json:
        write_document({"version": 1, "time": iso(now),
                        "reservations": [r.to_dict() | ({"beyond_max": True}
                                                        if r.beyond_max else {})
                                         for r in active],
                        "queue": [w.to_dict() for w in queue],
                        "lapsed": [w.to_dict() for w in lapsed]}, sys.stdout)
        return EXIT_OK
    for i, w in enumerate(queue):
        print(f"waiting {i + 1}: {clean(w.user)} for {w.count} GPU(s)"
              + (f" ({excerpt(w.want, 60)})" if w.want else "")
              + f" since {local_time(w.created)} [id {w.id}]")
    for w in lapsed:  # counts for nobody; the next write drops it
        print(f"lapsed: {clean(w.user)} for {w.count} GPU(s)"
              + (f" ({excerpt(w.want, 60)})" if w.want else "")
              + f", lease {'ended' if w.lease <= now else 'too far ahead'} [id {w.id}]")
    if not active:
        print("no reservations", file=sys.stderr)
        return EXIT_OK
    rows = [("GPU", "USER", "UNTIL", "LEFT", "NOTE")] + [
        (clean(r.target) + ("" if r.share_mib is None else f" ({size_text(r.share_mib)})"),
         clean(r.user), ends_with(r) or local_time(r.expires),
         ("" if r.job is None else "at most ")
         + format_duration((r.expires - now).total_seconds())
         + (" (beyond-max)" if r.beyond_max else ""), clean(r.note)[:60])
        for r in active]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[4])
    return EXIT_OK
