"""``gputop run --mine``: run on GPUs you already hold, and keep holding them afterwards.

A reservation you made before (``free --wait``, ``reserve``) is yours to use as often as
you like: ``run`` ties only the reservations it makes itself to its job, so here nothing is
tied to the job and nothing is released when it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from gputop.cli.targets import host_config, nobody_answered, poll_hosts
from gputop.config.load import Config
from gputop.errors import EXIT_NO_HOST, EXIT_REFUSED
from gputop.model import HostSnapshot, utcnow
from gputop.reservations.ops import Invalid, whoami
from gputop.reservations.records import Reservation
from gputop.reservations.requests import Request
from gputop.reservations.store import ReservationStore
from gputop.text import clean


def idle_mine(store: ReservationStore, hosts: Sequence[HostSnapshot], me: str,
              only: Sequence[str] = ()) -> dict[str, list[Reservation]]:
    """Your whole-GPU reservations not tied to a job, on GPUs a host answered with no
    process on them, by host (GPU order). A GPU whose uuid is not the reserved one (it was
    renumbered) is not offered."""
    seen = {(h.name, g.index): g for h in hosts if h.ok for g in h.gpus}
    out: dict[str, list[Reservation]] = {}
    for r in sorted(store.read().active(utcnow()), key=lambda r: (r.host, r.gpu)):
        if (r.user != me or r.job is not None or r.instance is not None or r.is_share
                or (only and r.host not in only)):
            continue
        g = seen.get((r.host, r.gpu))
        if g is None or g.processes or (r.uuid and g.uuid and r.uuid != g.uuid):
            continue
        out.setdefault(r.host, []).append(r)
    return out


def describe(mine: dict[str, list[Reservation]]) -> str:
    return ", ".join(f"{clean(r.host)}:{r.gpu}" for rs in mine.values() for r in rs)


def run_mine(config: Config, args: argparse.Namespace, argv: list[str], req: Request,
             store: ReservationStore, count: int | None) -> int:
    """``count`` None: every idle GPU you hold on the one host you hold them on."""
    for flag, given in (("--wait", args.wait), ("--for", args.duration),
                        ("--min-free-memory", args.min_free_memory)):
        if given:
            raise Invalid(f"--mine runs on the GPUs you hold as they are: without {flag}")
    hosts = asyncio.run(poll_hosts(config, set(req.hosts) or None))
    if nobody := nobody_answered(hosts):
        print(f"gputop: {nobody}", file=sys.stderr)
        return EXIT_NO_HOST
    mine = idle_mine(store, hosts, whoami(store)[0], req.hosts)
    want = count or 1
    fits = [h for h, rs in mine.items() if len(rs) >= want]
    if not fits:
        print("gputop: " + (f"you hold {want} idle GPU(s) on no one host (yours now: "
                            f"{describe(mine)})" if mine else
                            "you hold no idle GPU (reserve some: gputop free --count N --wait)")
              + "; --mine runs only on your own reservations", file=sys.stderr)
        return EXIT_REFUSED
    if count is None and len(mine) > 1:
        print(f"gputop: you hold idle GPUs on {len(mine)} hosts ({describe(mine)}): say which "
              "with --host, or how many with --count", file=sys.stderr)
        return EXIT_REFUSED
    got = mine[fits[0]][:count] if count else mine[fits[0]]
    from gputop.jobs.run import run_on

    print(f"gputop: running on your {', '.join(f'{clean(r.host)}:{r.gpu}' for r in got)} "
          "(they stay reserved for you afterwards)", file=sys.stderr, flush=True)

    def say(msg: str) -> None:
        print(f"gputop: {msg}", file=sys.stderr, flush=True)

    return asyncio.run(run_on(config, host_config(config, got[0].host), store, got, argv,
                              say, keep=True))
