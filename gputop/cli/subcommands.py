"""The subcommands' parsers and their dispatch (each maps to a ``cmd_*``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

from gputop.cli.free import cmd_free
from gputop.cli.lifecycle import EXIT_ERROR, EXIT_HUB, EXIT_OK, EXIT_REFUSED
from gputop.cli.reserve import cmd_release, cmd_reservations, cmd_reserve
from gputop.cli.run import cmd_run
from gputop.cli.serve import add_serve, cmd_serve
from gputop.config import Config
from gputop.history.db import HistoryError
from gputop.reservations import (
    Invalid,
    Refused,
    StoreError,
)
from gputop.sources import HubError


def cmd_record(config: Config, args: argparse.Namespace) -> int:
    from pathlib import Path

    from gputop.history.live import record_forever

    try:
        asyncio.run(record_forever(config, Path(args.db).expanduser() if args.db else None))
    except asyncio.CancelledError:  # SIGTERM: stopped cleanly, everything committed
        pass
    return EXIT_OK

def cmd_report(config: Config, args: argparse.Namespace) -> int:
    from gputop.history.cli import report

    return report(config, args)

COMMANDS = {"reserve": cmd_reserve, "release": cmd_release, "reservations": cmd_reservations,
            "free": cmd_free, "run": cmd_run, "record": cmd_record, "report": cmd_report,
            "serve": cmd_serve}

def _queue_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--count", type=int, default=1, metavar="N", help="how many (default 1)")
    p.add_argument("--min-free-memory", metavar="SIZE", help="e.g. 20G")
    p.add_argument("--host", metavar="HOST", help="only this host")
    p.add_argument("--tag", metavar="TAG", help="only hosts with this tag")
    p.add_argument("--max-wait", metavar="DURATION", help="with --wait: give up after this")
    p.add_argument("--notify", metavar="CMD",
                   help="with --wait: run this shell command when the wait ends "
                   "(GPUTOP_RESULT, GPUTOP_GPUS, GPUTOP_UUIDS in its environment)")
    p.add_argument("--lease", type=float, metavar="SECONDS", help=argparse.SUPPRESS)

def add_subcommands(parser: argparse.ArgumentParser,
                    parents: Sequence[argparse.ArgumentParser] = ()) -> Any:
    """The reservation subcommands; ``parents`` adds the global options to each, so they
    work after the subcommand too. Returns the subparsers, for the CLI to add its own."""
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parents = list(parents)
    p = sub.add_parser("reserve", parents=parents,
                       help="reserve GPUs: HOST:GPU[,GPU...] (all or nothing); "
                       "a MIG instance: HOST:GPU/INSTANCE or HOST:MIG-<uuid>")
    p.add_argument("targets", nargs="+", metavar="HOST:GPU[,GPU...]")
    p.add_argument("--for", dest="duration", metavar="DURATION",
                   help="how long, e.g. 90m, 2h, 1d (default from the config: 4h)")
    p.add_argument("--note", help="what it is for (shown to the team)")
    p.add_argument("--until-exit", type=int, metavar="PID",
                   help="release it once process PID (on that host) has ended")
    p.add_argument("--skip-queue", action="store_true",
                   help="reserve even a GPU that people in the queue wait for (recorded in "
                   "the file with your name)")
    p = sub.add_parser("release", parents=parents,
                       help="release GPUs you reserved, or a place in the queue (--waiter)")
    p.add_argument("targets", nargs="*", metavar="HOST:GPU[,GPU...]")
    p.add_argument("--mine", action="store_true", help="release all of your reservations")
    p.add_argument("--force", action="store_true",
                   help="release someone else's reservation or waiter (recorded with your "
                   "name)")
    p.add_argument("--waiter", metavar="ID",
                   help="take waiter ID (from gputop reservations) out of the queue: "
                   "your own, or with --force anyone's")
    p = sub.add_parser("reservations", parents=parents, help="list current reservations")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = sub.add_parser("free", parents=parents,
                       help="list idle, unreserved GPUs (and MIG instances), best first")
    _queue_options(p)
    p.add_argument("--whole", action="store_true", help="whole GPUs only, no MIG instances")
    p.add_argument("--reserve", action="store_true", help="reserve what was found, atomically")
    p.add_argument("--wait", action="store_true",
                   help="not enough free: wait your turn in the team's queue, then reserve "
                   "(implies --reserve)")
    p.add_argument("--for", dest="duration", metavar="DURATION", help="with --reserve")
    p.add_argument("--note", help="with --reserve")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = sub.add_parser("run", parents=parents,
                       help="reserve GPUs on one host, run CMD there on them, release them")
    _queue_options(p)
    p.add_argument("--wait", action="store_true", help="wait your turn in the queue")
    p.add_argument("--for", dest="duration", metavar="DURATION",
                   help="longest the reservation lasts (default: max_duration); it is "
                   "released when the job ends")
    p.add_argument("--note", help="what it is for (shown to the team)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS",
                   help="the command and its arguments")
    p = sub.add_parser("record", parents=parents,
                       help="record every host's GPUs, owners and reservations "
                       "into the history database (runs until stopped)")
    p.add_argument("--db", metavar="FILE", help="history database (default: [history] path)")
    p = sub.add_parser("report", parents=parents,
                       help="GPU-hours used, reserved and wasted, per user, host "
                       "and GPU, from the history database")
    p.add_argument("--db", metavar="FILE", help="history database (default: [history] path)")
    p.add_argument("--since", metavar="DURATION", help="the last DURATION, e.g. 7d (default)")
    p.add_argument("--from", dest="start", metavar="DATE",
                   help="start: 2026-11-01 or 2026-11-01T09:00 (local time unless it says)")
    p.add_argument("--to", dest="end", metavar="DATE", help="end (default: now)")
    p.add_argument("--by", choices=("user", "host", "gpu"), default="user",
                   help="the table to show (default: user)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print everything as JSON")
    fmt.add_argument("--csv", action="store_true", help="print the --by table as CSV")
    p.add_argument("--plot", metavar="FILE", help="also draw FILE.png or FILE.svg "
                   "(needs matplotlib: pip install 'gputop[plot]')")
    add_serve(sub, parents)
    return sub

def run_command(config: Config, args: argparse.Namespace) -> int:
    try:
        return COMMANDS[args.command](config, args)
    except Refused as exc:
        print(f"gputop: refused: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except (Invalid, ValueError) as exc:
        print(f"gputop: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except StoreError as exc:
        print(f"gputop: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except HistoryError as exc:
        print(f"gputop: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except HubError as exc:
        print(f"gputop: {exc}", file=sys.stderr)
        return EXIT_HUB
