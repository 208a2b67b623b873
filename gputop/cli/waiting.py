"""Waiting in the team's queue from a command (``free --wait``, ``run --wait``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

from gputop.cli.targets import max_wait_s
from gputop.config.load import Config
from gputop.errors import EXIT_NO_HOST, EXIT_OK, EXIT_REFUSED
from gputop.reservations.ops import Invalid
from gputop.reservations.queue import DEFAULT_LEASE_S
from gputop.reservations.records import MAX_LEASE_S, Job, Reservation
from gputop.reservations.requests import Request
from gputop.reservations.store import ReservationStore


def wait_in_queue(config: Config, store: ReservationStore, req: Request, args: argparse.Namespace,
                  *,
          seconds: float, job: Job | None = None) -> tuple[int, list[Reservation]]:
    """Wait in the queue (Ctrl-C, SIGTERM, SIGHUP leave it at once): (exit code, grant)."""
    from gputop.cli.lifecycle import run_until_signal
    from gputop.jobs.reap import check_jobs
    from gputop.jobs.wait import CannotReach, WaitedTooLong, wait_for_gpus

    got: list[Reservation] = []
    lease = args.lease if args.lease is not None else DEFAULT_LEASE_S
    if not 1 <= lease <= MAX_LEASE_S:  # (NaN fails both)
        raise Invalid(f"--lease must be between 1 and {MAX_LEASE_S:.0f} seconds")
    max_wait = max_wait_s(args.max_wait)

    def say(msg: str) -> None:
        print(f"gputop: {msg}", file=sys.stderr, flush=True)

    async def main() -> int:
        last_reap = [0.0]
        pending: set[asyncio.Task[Any]] = set()

        def reaper() -> None:  # in the background, at most every few intervals
            loop = asyncio.get_running_loop()
            if loop.time() - last_reap[0] < max(5.0, 3 * config.defaults.interval) or pending:
                return
            last_reap[0] = loop.time()
            t = loop.create_task(check_jobs(config, store))
            pending.add(t)
            t.add_done_callback(pending.discard)

        try:
            got.extend(await wait_for_gpus(
                config, store, req, seconds=seconds, note=args.note or "", lease_s=lease,
                max_wait=max_wait, say=say, job=(lambda h: job) if job else None,
                reaper=reaper, verbose=bool(getattr(args, "verbose", False))))
        except WaitedTooLong as exc:
            say(str(exc))
            # (no host it waits on answered for minutes: as free says when none answers)
            return EXIT_NO_HOST if isinstance(exc, CannotReach) else EXIT_REFUSED
        finally:
            for t in pending:
                t.cancel()
        return EXIT_OK

    code = run_until_signal(main)
    if code != EXIT_OK or not got:
        notify(args, "timeout" if code in (EXIT_REFUSED, EXIT_NO_HOST) else "interrupted",
               [])
        return code or EXIT_REFUSED, []
    notify(args, "granted", got)
    return EXIT_OK, got

def notify(args: argparse.Namespace, result: str, got: Sequence[Reservation]) -> None:
    """The terminal bell (on a grant with a desktop notification too: ``notify.bell``),
    and ``--notify CMD`` (your own shell command) with the result in its environment:
    GPUTOP_RESULT, GPUTOP_GPUS (HOST:GPU,...), GPUTOP_UUIDS."""
    import os
    import subprocess

    from gputop.notify.bell import ring

    if result == "granted":
        gpus = ", ".join(r.target for r in got)
        ring(sys.stderr, "gputop: GPUs granted", gpus)
    elif sys.stderr.isatty():
        sys.stderr.write("\a")
        sys.stderr.flush()
    if not getattr(args, "notify", None):
        return
    env = dict(os.environ, GPUTOP_RESULT=result,
               GPUTOP_GPUS=",".join(f"{r.host}:{r.gpu}" for r in got),
               GPUTOP_UUIDS=",".join(r.uuid or "" for r in got))
    try:
        # Your own command line, as you typed it; the results are only in its environment.
        subprocess.run(["/bin/sh", "-c", args.notify], env=env, stdin=subprocess.DEVNULL,
                       timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"gputop: --notify failed: {exc}", file=sys.stderr)
