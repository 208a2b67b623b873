"""``gputop report``'s command line: the range, the database, the output form."""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime
from pathlib import Path

from gputop.config.load import Config
from gputop.config.values import parse_duration
from gputop.errors import UsageError
from gputop.history.db import HistoryDB
from gputop.history.render import write_csv, write_plot, write_text
from gputop.history.report import collect, summarise
from gputop.output import write_document

DEFAULT_SINCE = "7d"


def parse_when(text: str, flag: str) -> float:
    """``2026-11-01``, ``2026-11-01T09:00[:SS]``, with ``Z`` or an offset for UTC, else local
    time, to epoch seconds."""
    try:
        t = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(f"{flag} {text}: not a date; use e.g. 2026-11-01 or "
                         "2026-11-01T09:00") from None
    if t.tzinfo is None:
        t = t.astimezone()  # local time, as people read it
    return t.timestamp()


def time_range(args: argparse.Namespace, now: float) -> tuple[float, float]:
    if args.since and (args.start or args.end):
        raise UsageError("give --since, or --from/--to, not both")
    end = parse_when(args.end, "--to") if args.end else now
    if args.start:
        start = parse_when(args.start, "--from")
    else:
        try:
            start = end - parse_duration(args.since or DEFAULT_SINCE)
        except ValueError:
            raise UsageError(f"--since {args.since}: not a duration; use e.g. 2h, 7d, "
                             "4w") from None
    if start >= end:
        raise UsageError("--from must be before --to")
    return start, end


def report(config: Config, args: argparse.Namespace) -> int:
    start, end = time_range(args, time.time())
    path = Path(args.db).expanduser() if args.db else config.history.path
    with HistoryDB(path) as db:
        doc = summarise(collect(db, start, end))
    if args.plot:
        plot = Path(args.plot)
        if plot.suffix.lower() not in (".png", ".svg"):
            raise UsageError(f"--plot {args.plot}: name a .png or .svg file")
        write_plot(doc, plot)
    if args.json:
        write_document(doc, sys.stdout)
    elif args.csv:
        write_csv(doc, args.by, sys.stdout)
    else:
        write_text(doc, args.by, sys.stdout)
    return 0
