"""``gputop free``: every idle GPU nobody else holds, best first (your own reservations
marked yours); ``--count N`` picks the best N, ``--reserve`` takes them, ``--wait`` queues.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from gputop.cli.free_table import is_terminal, print_free, yours
from gputop.cli.reserve import print_outcomes
from gputop.cli.targets import (
    check_reservable,
    nobody_answered,
    not_answering,
    open_store,
    poll_hosts,
    queue_request,
    reap_ended_jobs,
    reservation_seconds,
)
from gputop.cli.waiting import wait_in_queue
from gputop.config.load import Config
from gputop.errors import EXIT_NO_HOST, EXIT_OK, EXIT_REFUSED
from gputop.model import iso, utcnow
from gputop.output import write_document
from gputop.reservations.ops import Outcome, reserve_outcomes, whoami
from gputop.reservations.order import QueueView
from gputop.reservations.queue import queue_claim
from gputop.reservations.terms import Target, Terms


def cmd_free(config: Config, args: argparse.Namespace) -> int:
    every = args.count is None and not (args.reserve or args.wait)
    if args.count is None:
        args.count = 1
    if args.reserve or args.wait:
        check_reservable(config, f"free --{'wait' if args.wait else 'reserve'}")
    if getattr(args, "share", None) is not None:
        from gputop.cli.shares import free_share_cmd

        return free_share_cmd(config, args)
    req = queue_request(config, args, one_host=False)
    store = open_store(config)
    reap_ended_jobs(config, store)
    if args.wait:  # --wait queues for a reservation: it implies --reserve
        seconds = reservation_seconds(config, args.duration)
        code, got = wait_in_queue(config, store, req, args, seconds=seconds)
        if code != EXIT_OK:
            if args.json:
                write_document({"version": 1, "reserved": False, "free": []}, sys.stdout)
            return code
        print_outcomes([Outcome("reserved", r) for r in got], sys.stderr)
        if args.json:
            write_document({"version": 1, "reserved": True, "free": [
                {"host": g.host, "gpu": g.gpu, "uuid": g.uuid, "expires": iso(g.expires)}
                for g in got]}, sys.stdout)
        else:
            for g in got:
                print(f"{g.host}:{g.gpu}")
        return EXIT_OK
    hosts = asyncio.run(poll_hosts(config, set(req.hosts) or None))
    me = whoami(open_store(config))[0]
    state = store.read()
    # The order rule: without --wait you come after every waiter, so you may take only
    # what delays none of them; how long you would hold it counts (backfill).
    waiters = [w for w in state.waiting() if w.user != me]
    fleet = [h.name for h in config.hosts]
    found = QueueView(state, hosts, utcnow(), fleet, me).offered(
        req, whole=args.whole, seconds=reservation_seconds(config, args.duration))
    if not every:
        found = found[: args.count]
    if len(found) < args.count and (nobody := nobody_answered(hosts)):
        # Not "0 free": nothing is known. Said first, with why, and told apart by its code.
        print(f"gputop: {nobody}", file=sys.stderr)
        if args.json:
            write_document({"version": 1, "free": []}, sys.stdout)
        return EXIT_NO_HOST
    if len(found) < args.count:
        if found and not args.json and is_terminal(sys.stdout):  # a pipe gets none: scripts
            print_free(found, state, utcnow())                   # test for all or nothing
        print(f"gputop: {len(found)} free" + ("" if every else f", {args.count} wanted")
              + (f" ({len(waiters)} waiting in the queue; --wait joins it)" if waiters else
                 " (--wait to queue for them)") + not_answering(hosts), file=sys.stderr)
        if args.json:
            write_document({"version": 1, "free": []}, sys.stdout)
        return EXIT_REFUSED
    expires: dict[str, str | None] = {}
    if args.reserve:
        from gputop.jobs.remote import logins

        seconds = reservation_seconds(config, args.duration)
        targets = [Target(f.host, f.gpu.index or 0, f.gpu.uuid,
                          f.instance.gpu_instance_id if f.instance else None) for f in found]
        # Checked again under the lock: a waiter who joined meanwhile is served first.
        made = reserve_outcomes(
            store, targets, Terms(seconds, config.reservations.max_s, args.note or "",
                                  login=logins(config)),
            check=queue_claim(targets, {h.name: h for h in hosts}, fleet, me,
                              seconds=seconds))
        print_outcomes(made, sys.stderr)  # stdout stays HOST:GPU lines for scripts
        # An instance covered by your whole-GPU reservation: that one's expiry.
        for f in found:
            r = next((o.reservation for o in made if o.reservation.target == f.label), None) \
                or next((o.reservation for o in made
                         if o.reservation.target == f"{f.host}:{f.gpu.index}"), None)
            expires[f.label] = iso(r.expires) if r else None
    now = utcnow()
    if args.json:
        write_document({"version": 1, "reserved": bool(args.reserve), "free": [
            {"host": f.host, "gpu": f.gpu.index, "uuid": f.gpu.uuid, "name": f.gpu.name,
             "memory_free_mib": f.free_mib, "yours": yours(f, state, now) is not None}
            | ({"instance": f.instance.gpu_instance_id, "profile": f.instance.profile,
                "mig_uuid": f.instance.uuid} if f.instance else {})
            | ({"expires": expires.get(f.label)} if args.reserve else {})
            for f in found]}, sys.stdout)
    else:
        print_free(found, store.read() if args.reserve else state, now)
    return EXIT_OK

