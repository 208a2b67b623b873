"""``gputop run``: reserve GPUs on one host, run a command there on them, release them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from gputop.cli.targets import (
    check_reservable,
    host_config,
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
from gputop.reservations.ops import Invalid
from gputop.reservations.queue import (
    unsatisfiable,
)
from gputop.reservations.records import Job, Reservation
from gputop.reservations.terms import Terms
from gputop.text import clean


def cmd_run(config: Config, args: argparse.Namespace) -> int:
    argv = list(args.cmd)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise Invalid("say what to run: gputop run [--count N] ... -- CMD ARGS...")
    check_reservable(config, "run")
    if getattr(args, "share", None) is not None:
        from gputop.cli.shares import run_share

        return run_share(config, args, argv)
    req = queue_request(config, args, one_host=True)
    seconds = (reservation_seconds(config, args.duration) if args.duration
               else config.reservations.max_s)
    store = open_store(config)
    reap_ended_jobs(config, store)
    from gputop.jobs.remote import local_start

    # Tied to the job from the start, and to this process until the job's pid is recorded
    # (a run killed before that is released after the grace: see jobs.reap).
    pending = Job(None, session=True, runner=os.getpid(), runner_start=local_start(os.getpid()))
    got: list[Reservation] = []
    if args.wait:
        code, got = wait_in_queue(config, store, req, args, seconds=seconds, job=pending)
        if code != EXIT_OK:
            return code
    else:
        from gputop.reservations.queue import reserve_now

        hosts = asyncio.run(poll_hosts(config, set(req.hosts) or None))
        if nobody := nobody_answered(hosts):
            print(f"gputop: {nobody}", file=sys.stderr)
            return EXIT_NO_HOST
        fleet = [h.name for h in config.hosts]
        why = unsatisfiable(req, hosts, fleet)
        if why:
            raise Invalid(f"{why}; ask for fewer GPUs or less memory (or name other hosts)")
        from gputop.jobs.remote import logins

        terms = Terms(seconds, note=args.note or "", job=lambda h: pending,
                      login=logins(config))
        made = reserve_now(store, req, hosts, terms, fleet)
        if made is None:
            waiting = len(store.read().waiting())
            print(f"gputop: not {req.count} free GPU(s) on one host"
                  + (f" that none of the {waiting} waiting could use" if waiting else "")
                  + "; --wait to queue for them" + not_answering(hosts), file=sys.stderr)
            return EXIT_REFUSED
        got = made
    from gputop.jobs.run import run_on

    host = host_config(config, got[0].host)
    print(f"gputop: running on {', '.join(f'{clean(r.host)}:{r.gpu}' for r in got)}",
          file=sys.stderr, flush=True)

    def say(msg: str) -> None:
        print(f"gputop: {msg}", file=sys.stderr, flush=True)

    return asyncio.run(run_on(config, host, store, got, argv, say))
