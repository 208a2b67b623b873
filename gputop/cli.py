"""The ``gputop`` command. Exit codes are API: 0 done, 1 refused, 2 usage/config/store error,
130 interrupted. The board (Textual) is imported only when it is shown, so ``--json`` and
the reservation commands never load it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from collections.abc import Sequence

from gputop import __version__
from gputop.config import NO_CONFIG_HINT, Config, ConfigError, default_config_path, load_config

EXIT_OK, EXIT_REFUSED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """A bad command line or argument: reported in one line, exit 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gputop",
        description="One live board of every GPU on your team's servers.",
        epilog="Exit codes: 0 done, 1 refused (conflict, nothing free), "
        "2 usage, config or store error, 130 interrupted.",
    )
    p.add_argument("--version", action="version", version=f"gputop {__version__}")
    p.add_argument("--config", metavar="FILE",
                   help=f"hosts file (default: $GPUTOP_CONFIG, else {default_config_path()})")
    p.add_argument("--json", action="store_true",
                   help="print one JSON snapshot of every host to stdout and exit")
    p.add_argument("--watch", action="store_true",
                   help="with --json: print one document per refresh (one per line)")
    p.add_argument("--pretty", action="store_true", help="with --json: indent the document")
    p.add_argument("--interval", type=float, metavar="SECONDS",
                   help="seconds between refreshes (overrides the config)")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="per-host timeout for connect + one query (overrides the config)")
    p.add_argument("--demo", action="store_true",
                   help="show the board on a built-in simulated fleet (no SSH, no GPU needed)")
    p.add_argument("--theme", metavar="NAME", help="board theme (see themes/)")
    from gputop.commands import add_subcommands

    add_subcommands(p)
    return p


def _apply_overrides(config: Config, args: argparse.Namespace) -> Config:
    from dataclasses import replace

    if args.interval is not None:
        if args.interval < 0.1:
            raise UsageError("--interval must be at least 0.1 seconds")
        config = replace(config, interval=args.interval)
    if args.timeout is not None:
        if args.timeout < 0.5:
            raise UsageError("--timeout must be at least 0.5 seconds")
        config = replace(config, timeout=args.timeout)
    return config


async def _json(config: Config, *, watch: bool, pretty: bool) -> None:
    """One document, or (``watch``) one per refresh, each with reservations and flags."""
    import time

    from gputop.output import write_document
    from gputop.poller import Poller
    from gputop.reservations import Store, StoreError
    from gputop.reservations.flags import IdleTracker, annotate

    # One document: one query per host is cheaper for the hosts than starting streams.
    poller = Poller(config if watch else dataclasses.replace(config, collection="query"))
    store = Store(config.reservations_path)
    tracker = IdleTracker(config.idle_holder_s, config.idle_grace_s)
    reported: str | None = None
    try:
        while True:
            started = time.monotonic()
            snap = await poller.snapshot()
            for host in snap.hosts:
                tracker.observe(host)
            try:
                state, problem = store.read(), None
            except StoreError as exc:
                state, problem = None, str(exc)
                if problem != reported:
                    print(f"gputop: {problem}", file=sys.stderr)
            reported = problem
            doc = annotate(snap, state, tracker)
            if problem:
                doc["reservations_error"] = problem
            write_document(doc, sys.stdout, pretty=pretty)
            if not watch:
                return
            await asyncio.sleep(max(0.0, config.interval - (time.monotonic() - started)))
    finally:
        await poller.aclose()


def _run_json(config: Config, args: argparse.Namespace) -> int:
    if config.implicit:
        print("gputop: " + NO_CONFIG_HINT.format(path=default_config_path()), file=sys.stderr)
    asyncio.run(_json(config, watch=args.watch, pretty=args.pretty))
    return EXIT_OK


def _run_board(config: Config | None, args: argparse.Namespace) -> int:
    try:
        from gputop.ui.app import run_board
    except ImportError as exc:  # pragma: no cover - the board ships with gputop
        print(f"gputop: the board is unavailable: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return run_board(config, demo=args.demo, theme=args.theme)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.watch and not args.json:
            raise UsageError("--watch needs --json")
        if args.demo:
            return _run_board(None, args)
        config = _apply_overrides(load_config(args.config), args)
        if args.command:
            from gputop.commands import run_command

            return run_command(config, args)
        if args.json:
            return _run_json(config, args)
        return _run_board(config, args)
    except (ConfigError, UsageError) as exc:
        print(f"gputop: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``gputop --json --watch | head -1``): not an error.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
