"""The subcommands' parsers and their dispatch (each maps to a ``cmd_*``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from gputop.cli.free import cmd_free
from gputop.cli.notify import add_notify, cmd_notify
from gputop.cli.options import for_subcommand
from gputop.cli.reserve import cmd_extend, cmd_release, cmd_reservations, cmd_reserve
from gputop.cli.run import cmd_run
from gputop.cli.serve import add_serve, cmd_serve
from gputop.config.load import Config
from gputop.errors import EXIT_OK
from gputop.extras import require


def recorder_command(config: Config, args: argparse.Namespace) -> list[str]:
    """``gputop record`` as a service runs it: this very gputop (the script on PATH, else
    this interpreter with ``-m gputop``) and what this run read, all absolute."""
    from pathlib import Path

    from gputop.history.unit import this_gputop

    cmd = this_gputop("record")
    if config.path is not None:
        cmd += ["--config", str(config.path.expanduser().absolute())]
    if args.db:
        cmd += ["--db", str(Path(args.db).expanduser().absolute())]
    if args.interval is not None:
        cmd += ["--interval", f"{args.interval:g}"]
    if args.timeout is not None:
        cmd += ["--timeout", f"{args.timeout:g}"]
    return cmd

def cmd_record(config: Config, args: argparse.Namespace) -> int:
    from pathlib import Path

    from gputop.history.live import record_forever

    if args.print_unit:
        from gputop.history.unit import unit_text

        sys.stdout.write(unit_text(recorder_command(config, args)))
        return EXIT_OK
    try:
        asyncio.run(record_forever(config, Path(args.db).expanduser() if args.db else None))
    except asyncio.CancelledError:  # SIGTERM: stopped cleanly, everything committed
        pass
    return EXIT_OK

def cmd_mcp(config: Config, args: argparse.Namespace) -> int:
    from gputop.cli.lifecycle import run_until_signal

    require("mcp")
    from gputop.agents.mcp import serve
    if config.implicit:
        print(f"gputop: no hosts file ({config.path}): the server has no hosts; run gputop "
              "init-config, or give --config", file=sys.stderr)
    return run_until_signal(lambda: serve(config))

def cmd_report(config: Config, args: argparse.Namespace) -> int:
    from gputop.history.cli import report

    return report(config, args)

COMMANDS = {"reserve": cmd_reserve, "extend": cmd_extend, "release": cmd_release,
            "reservations": cmd_reservations, "free": cmd_free, "run": cmd_run,
            "record": cmd_record, "report": cmd_report, "mcp": cmd_mcp, "serve": cmd_serve,
            "notify": cmd_notify}

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
    p.add_argument("-v", "--verbose", action="store_true",
                   help="say each host's error, not only which do not answer")

def add_subcommands(parser: argparse.ArgumentParser) -> Any:
    """The reservation, queue, run and history subcommands, each with a description and
    the global options it uses (:mod:`gputop.cli.options`), which work after the
    subcommand too. Returns the subparsers, for the CLI to add its own."""
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, help: str, description: str) -> argparse.ArgumentParser:
        # run's own options are spelt out: what follows them is a command whose options
        # (`python x.py --h`) argparse would otherwise read as run's, and refuse as
        # ambiguous, before the command is seen.
        return sub.add_parser(name, parents=for_subcommand(name), help=help,
                              description=description, allow_abbrev=name != "run")

    p = add("reserve", "reserve GPUs: HOST:GPU[,GPU...] (all or nothing); "
            "a MIG instance: HOST:GPU/INSTANCE or HOST:MIG-<uuid>",
            "Reserve GPUs in the team's shared reservations file, all or nothing: "
            "gputop reserve gpu-01:0,1 --for 2h --note 'sweep 7'. Advisory: nobody's job is "
            "stopped, but everyone's gputop shows who holds what and flags misuse. Your own "
            "reservation is extended (or kept, if it already lasts longer); a GPU someone "
            "else holds, or that a waiter in the queue could use, is refused (exit 1).")
    p.add_argument("targets", nargs="+", metavar="HOST:GPU[,GPU...]")
    p.add_argument("--for", dest="duration", metavar="DURATION",
                   help="how long, e.g. 90m, 2h, 1d (default from the config: 4h)")
    p.add_argument("--note", help="what it is for (shown to the team)")
    p.add_argument("--until-exit", type=int, metavar="PID",
                   help="release it once process PID (on that host) has ended")
    p.add_argument("--share", metavar="SIZE",
                   help="a share of one GPU's memory, e.g. 16G (several people share a GPU "
                   "until its memory is committed)")
    p.add_argument("--skip-queue", action="store_true",
                   help="reserve even a GPU that people in the queue wait for (recorded in "
                   "the file with your name)")
    p = add("extend", "give your own reservations more time: HOST:GPU[,GPU...] --for D",
            "Give GPUs you hold more time, by the same rules as reserve (at most the team's "
            "max_duration; and while people wait, holding a GPU longer than you do now is "
            "judged as taking it anew): gputop extend gpu-01:0 --for 1h. Never reserves a GPU "
            "you do not hold (exit 2).")
    p.add_argument("targets", nargs="+", metavar="HOST:GPU[,GPU...]")
    p.add_argument("--for", dest="duration", metavar="DURATION", required=True,
                   help="how long from now, e.g. 1h")
    p = add("release", "release GPUs you reserved, or a place in the queue (--waiter)",
            "Release your reservations (gputop release gpu-01:0,1, or --mine for all), "
            "someone else's with --force (recorded in the file with your name), or take a "
            "place out of the queue with --waiter ID.")
    p.add_argument("targets", nargs="*", metavar="HOST:GPU[,GPU...]")
    p.add_argument("--mine", action="store_true", help="release all of your reservations")
    p.add_argument("--force", action="store_true",
                   help="release someone else's reservation or waiter (recorded with your "
                   "name)")
    p.add_argument("--waiter", metavar="ID",
                   help="take waiter ID (from gputop reservations) out of the queue: "
                   "your own, or with --force anyone's")
    p = add("reservations", "list current reservations",
            "List the current reservations (GPU, holder, until when, time left, note) and "
            "the queue (who waits for what, since when, each waiter's id), in local time; "
            "--json in UTC.")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = add("free", "list idle, unreserved GPUs (and MIG instances), best first",
            "List every idle GPU (and MIG instance) nobody else holds, most free memory "
            "first. On a terminal: a table with model, free memory, load and your own "
            "reservations; in a pipe: HOST:GPU lines, for scripts. --count N picks the best "
            "N; fewer free: exit 1 (--wait queues for them). --reserve reserves the first N "
            "(default 1) in one write; "
            "--wait waits your turn in the team's queue, then reserves.")
    _queue_options(p)
    p.set_defaults(count=None)  # none given: list every free GPU
    p.add_argument("--whole", action="store_true", help="whole GPUs only, no MIG instances")
    p.add_argument("--share", metavar="SIZE",
                   help="a GPU with SIZE to share (best fit: one already shared first)")
    p.add_argument("--reserve", action="store_true", help="reserve what was found, atomically")
    p.add_argument("--wait", action="store_true",
                   help="not enough free: wait your turn in the team's queue, then reserve "
                   "(implies --reserve)")
    p.add_argument("--for", dest="duration", metavar="DURATION",
                   help="how long you would hold them (--reserve, --wait); what is offered "
                   "depends on it when people wait (default from the config)")
    p.add_argument("--note", help="with --reserve")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = add("run", "reserve GPUs on one host, run CMD there on them, release them",
            "Pick (or, with --wait, wait for) --count free GPUs on one host, reserve them, run "
            "CMD there over SSH with CUDA_VISIBLE_DEVICES set to them, and release them when "
            "the job ends: gputop run --count 2 --wait -- python train.py. Exits with the "
            "job's status (255: the SSH connection failed).")
    _queue_options(p)
    p.add_argument("--wait", action="store_true", help="wait your turn in the queue")
    p.add_argument("--mine", action="store_true",
                   help="run on your own idle reservations of one host (--count N of them; "
                   "default: all of them) and keep them reserved afterwards")
    p.set_defaults(count=None)  # (--mine without --count: every GPU you hold there)
    p.add_argument("--share", metavar="SIZE",
                   help="run on a share of one GPU's memory, e.g. 16G (exported to the job "
                   "as GPUTOP_SHARE_MIB and the frameworks' own memory caps)")
    p.add_argument("--for", dest="duration", metavar="DURATION",
                   help="longest the reservation lasts (default: max_duration); it is "
                   "released when the job ends")
    p.add_argument("--note", help="what it is for (shown to the team)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS",
                   help="the command and its arguments")
    p = add("record", "record every host's GPUs, owners and reservations "
            "into the history database (runs until stopped)",
            "Record every refresh of every host (GPUs, load, memory, process owners, "
            "reservations) into the history database that gputop report reads. One recorder "
            "per database, on one machine, on local disk; --print-unit prints a systemd user "
            "unit that runs it.")
    p.add_argument("--db", metavar="FILE", help="history database (default: [history] path)")
    p.add_argument("--print-unit", action="store_true",
                   help="print a systemd user unit that runs this gputop's recorder (with "
                   "this --config, --db, --interval, --timeout) and exit")
    p = add("report", "GPU-hours used, reserved and wasted, per user, host "
            "and GPU, from the history database",
            "Say who used, reserved and wasted how many GPU-hours (busy, idle, held idle, "
            "no data), per user, host or GPU, from what gputop record wrote; as text, "
            "--csv, --json or a --plot.")
    p.add_argument("--db", metavar="FILE", help="history database (default: [history] path)")
    p.add_argument("--since", metavar="DURATION", help="the last DURATION, e.g. 7d (default)")
    p.add_argument("--from", dest="start", metavar="DATE",
                   help="start: 2026-11-01 or 2026-11-01T09:00 (local time unless it says)")
    p.add_argument("--to", dest="end", metavar="DATE", help="end (default: now)")
    p.add_argument("--by", choices=("user", "host", "gpu"), default="user",
                   help="the table to show (default: user, then the host table)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print everything as JSON")
    fmt.add_argument("--csv", action="store_true", help="print the --by table as CSV")
    p.add_argument("--plot", metavar="FILE", help="also draw FILE.png or FILE.svg "
                   "(needs matplotlib: pip install '.[plot]' in the checkout, or "
                   "pipx inject gputop matplotlib)")
    add("mcp", "serve coding agents over MCP (stdio): find, reserve and release GPUs",
        "Serve the fleet to a coding agent as an MCP server on stdin/stdout: fleet_status, "
        "find_gpus, reserve, release, my_reservations, queue_status, wait_for_gpus. The "
        "agent acts as you (this process's login) under the team's rules. Register it "
        "with your MCP client, e.g. claude mcp add gputop -- gputop mcp (docs/mcp.md).")
    add_notify(sub, add)
    add_serve(sub)
    return sub

def run_command(config: Config, args: argparse.Namespace) -> int:
    return COMMANDS[args.command](config, args)
