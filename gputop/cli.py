"""The ``gputop`` command. Exit codes are API: 0 done, 1 refused, 2 usage/config/store error,
130 interrupted (128 + the signal's number for SIGTERM and SIGHUP too). The board (Textual) is
imported only when it is shown, so ``--json``, ``--once`` and the reservation commands never
load it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

from gputop import __version__
from gputop.config import NO_CONFIG_HINT, Config, ConfigError, default_config_path, load_config
from gputop.history.db import HistoryError
from gputop.model import FleetSnapshot, HostSnapshot
from gputop.pacing import set_pace
from gputop.sources import Source

EXIT_OK, EXIT_REFUSED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130
#: Signals that end ``--json``/``--once`` cleanly: every remote loop is ended first.
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
#: Subcommands that run before (and without) loading the hosts file.
NO_CONFIG_COMMANDS = ("init-config", "completion")
#: ``--watch`` handles the hosts' answers in batches at most this far apart (gputop.pacing),
#: and at most an eighth of the interval: at 2 s, a sample is written at most 0.25 s later
#: (a line every interval either way), for a third less CPU than at 50 ms (measured).
WATCH_PACE_S = 0.25


class UsageError(Exception):
    """A bad command line or argument: reported in one line, exit 2."""


def _global_options(*, sub: bool) -> argparse.ArgumentParser:
    """Options that work before or after the subcommand (``gputop reserve X --config F``).
    In a subcommand they default to SUPPRESS, so they never undo what came before it."""
    p = argparse.ArgumentParser(add_help=False)
    kw: dict[str, Any] = {"default": argparse.SUPPRESS} if sub else {}
    p.add_argument("--config", metavar="FILE", **kw,
                   help=f"hosts file (default: $GPUTOP_CONFIG, else {default_config_path()})")
    p.add_argument("--interval", type=float, metavar="SECONDS", **kw,
                   help="seconds between refreshes (overrides the config)")
    p.add_argument("--timeout", type=float, metavar="SECONDS", **kw,
                   help="per-host timeout for connect + one query (overrides the config)")
    p.add_argument("--theme", metavar="NAME", **kw,
                   help="board theme: gputop-dark, gputop-light, gputop-contrast or your own")
    return p


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gputop",
        description="One live board of every GPU on your team's servers.",
        epilog="Exit codes: 0 done, 1 refused (conflict, nothing free, file exists), "
        "2 usage, config or store error, 130 interrupted (143 SIGTERM, 129 SIGHUP).",
        parents=[_global_options(sub=False)],
    )
    p.add_argument("--version", action="version", version=f"gputop {__version__}")
    p.add_argument("--json", action="store_true",
                   help="print one JSON snapshot of every host to stdout and exit")
    p.add_argument("--watch", action="store_true",
                   help="with --json: one document per interval (one per line), each host's "
                   "latest state")
    p.add_argument("--pretty", action="store_true", help="with --json: indent the document")
    p.add_argument("--once", action="store_true",
                   help="print one table, a line per GPU, and exit (what gputop prints "
                   "when stdout is not a terminal)")
    p.add_argument("--demo", action="store_true",
                   help="a built-in simulated fleet (no SSH, no GPU needed): the board, "
                   "--json or --once")
    p.add_argument("--record", action="store_true",
                   help="board or --json --watch: also record every refresh into the history "
                   "database ([history] path), like `gputop record`")
    from gputop.commands import add_subcommands

    common = _global_options(sub=True)
    sub = add_subcommands(p, parents=[common])
    c = sub.add_parser("init-config", parents=[common],
                       help="write the documented example hosts file to the config path "
                       "(never overwrites)")
    c.add_argument("--stdout", action="store_true", help="print it instead of writing it")
    c = sub.add_parser("completion", parents=[common],
                       help="print a shell completion script: bash, zsh or fish")
    c.add_argument("shell", nargs="?", choices=("bash", "zsh", "fish"))
    c.add_argument("--candidates", choices=("hosts", "targets", "mine"),
                   help=argparse.SUPPRESS)  # what the scripts call back for
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


# --- ending cleanly on a signal ------------------------------------------------------------


def run_until_signal(make: Callable[[], Coroutine[Any, Any, int]], *,
                     paced: bool = False) -> int:
    """Run a coroutine; SIGTERM, SIGHUP or SIGINT cancel it, so its ``finally`` blocks end
    every remote loop before the process goes. Exit code 128 + the signal's number. A
    second signal while that cleanup runs ends the process at once. ``paced``: on a loop
    the coroutine may pace (:mod:`gputop.pacing`)."""

    async def main() -> int:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        got: list[int] = []

        def on_signal(signum: int) -> None:
            if got:
                os._exit(128 + signum)
            got.append(signum)
            task.cancel()

        for sig in EXIT_SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            return await make()
        except asyncio.CancelledError:
            if got:
                return 128 + got[0]
            raise
        finally:
            for sig in EXIT_SIGNALS:
                loop.remove_signal_handler(sig)

    if paced:
        from gputop.pacing import run_paced

        return run_paced(main())
    return asyncio.run(main())


# --- the fleet, real or simulated ----------------------------------------------------------


@contextlib.contextmanager
def _fleet(config: Config | None) -> Iterator[tuple[Config, list[Source] | None]]:
    """The config and sources to poll: the demo's (cleaned up after) or the real ones."""
    if config is None:
        from gputop.demo import demo_session

        with demo_session() as (demo_config, sources):
            yield demo_config, list(sources)
    else:
        if config.implicit:
            print("gputop: " + NO_CONFIG_HINT.format(path=default_config_path()),
                  file=sys.stderr)
        yield config, None


class _Reservations:
    """The shared file, read once per document; a broken file is reported once per change."""

    def __init__(self, config: Config) -> None:
        from gputop.reservations import Store

        self.store = Store(config.reservations_path)
        self.reported: str | None = None

    def read(self) -> tuple[Any, str | None]:
        from gputop.reservations import StoreError

        try:
            state, problem = self.store.read(), None
        except StoreError as exc:
            state, problem = None, str(exc)
            if problem != self.reported:
                print(f"gputop: {problem}", file=sys.stderr)
        self.reported = problem
        return state, problem


async def _json(config: Config, sources: list[Source] | None, *, watch: bool,
                pretty: bool, record: bool = False) -> int:
    """One document, or (``watch``) one per interval, each with reservations and flags."""
    from gputop.output import write_document
    from gputop.poller import Poller
    from gputop.reservations.flags import IdleTracker, annotate

    # One document: one query per host is cheaper for the hosts than starting streams.
    poller = Poller(config if watch else dataclasses.replace(config, collection="query"),
                    sources)
    reservations = _Reservations(config)
    tracker = IdleTracker(config.idle_holder_s, config.idle_grace_s)
    reaping = _JobReaper(config, reservations.store) if sources is None else None
    observe = tracker.observe
    live = None
    if record:
        from gputop.history.live import LiveRecorder

        live = LiveRecorder(config)  # a bad database is refused before anything is polled

        def observe(host: HostSnapshot) -> None:
            tracker.observe(host)
            assert live is not None
            live.observe(host)

    def emit(snap: FleetSnapshot) -> None:
        if reaping is not None:
            reaping.kick()
        state, problem = reservations.read()
        doc = annotate(snap, state, tracker)
        if problem:
            doc["reservations_error"] = problem
        write_document(doc, sys.stdout, pretty=pretty)

    try:
        if not watch:
            snap = await poller.snapshot()
            for host in snap.hosts:
                tracker.observe(host)
            if reaping is not None:
                await reaping.once()
            emit(snap)
            return EXIT_OK
        await watch_latest(poller, config.interval, emit, observe)
        return EXIT_OK  # pragma: no cover - watch_latest runs until cancelled
    finally:
        if reaping is not None:
            reaping.cancel()
        await poller.aclose()
        if live is not None:
            live.close()


class _JobReaper:
    """Releases job-tied reservations whose job ended (gputop.jobs.reap), in the background,
    at most every few intervals; only when the file holds such a reservation."""

    def __init__(self, config: Config, store: Any) -> None:
        self.config, self.store = config, store
        self.task: asyncio.Task[Any] | None = None
        self.last = -1e9

    def _due(self) -> bool:
        try:
            return any(r.job is not None for r in self.store.read().reservations)
        except Exception:  # reported by the document itself
            return False

    async def once(self) -> None:
        if self._due():
            from gputop.jobs.reap import check_jobs

            await check_jobs(self.config, self.store)

    def kick(self) -> None:
        loop = asyncio.get_running_loop()
        if (self.task is not None and not self.task.done()) or \
                loop.time() - self.last < max(5.0, 3 * self.config.interval):
            return
        self.last = loop.time()
        self.task = loop.create_task(self.once())

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()


async def watch_latest(poller: Any, interval: float, emit: Callable[[FleetSnapshot], None],
                       observe: Callable[[HostSnapshot], None]) -> None:
    """Every ``interval``, a snapshot of each host's latest state. Each host is polled by
    its own loop (``Poller.updates``), so a host whose refresh is still in flight keeps its
    last data (its ``time`` says how old) and never holds the others back. The first
    snapshot waits for every host's first answer, which its timeout bounds."""
    names = [s.name for s in poller.sources]
    latest: dict[str, HostSnapshot] = {}
    everyone = asyncio.Event()

    async def consume() -> None:
        async for snap in poller.updates():
            observe(snap)
            latest[snap.name] = snap
            if len(latest) == len(names):
                everyone.set()

    feed = asyncio.create_task(consume())
    try:
        first = asyncio.create_task(everyone.wait())
        await asyncio.wait({feed, first}, return_when=asyncio.FIRST_COMPLETED)
        first.cancel()
        if feed.done():  # the feed failed: say why
            feed.result()
        loop = asyncio.get_running_loop()
        # Every host answered once: from now on nothing here needs an answer the moment it
        # arrives, so the loop handles them in batches (a no-op on an unpaced loop).
        set_pace(min(WATCH_PACE_S, interval / 8))
        while True:
            started = loop.time()
            emit(FleetSnapshot(hosts=tuple(latest[n] for n in names)))
            await asyncio.sleep(max(0.0, interval - (loop.time() - started)))
    finally:
        feed.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feed


async def _table(config: Config, sources: list[Source] | None) -> int:
    """One snapshot as the human-readable table (see gputop/table.py)."""
    import shutil

    from gputop.poller import Poller
    from gputop.table import render

    poller = Poller(dataclasses.replace(config, collection="query"), sources)  # one query
    try:
        snap = await poller.snapshot()
    finally:
        await poller.aclose()
    state, _ = _Reservations(config).read()
    tty = sys.stdout.isatty()
    width: int | None = None
    if tty or os.environ.get("COLUMNS", "").isdigit():
        width = shutil.get_terminal_size().columns
    color = tty and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"
    sys.stdout.write(render(snap, state, width=width, color=color))
    sys.stdout.flush()
    return EXIT_OK


def _run_board(config: Config | None, args: argparse.Namespace) -> int:
    try:
        from gputop.ui.app import run_board
    except ImportError as exc:  # pragma: no cover - the board ships with gputop
        print(f"gputop: the board is unavailable: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return run_board(config, demo=args.demo, theme=args.theme, record=args.record)


def _on_terminal() -> bool:
    """The full-screen board needs a terminal for keys and for the screen (Textual draws on
    stderr); anything else gets the table."""
    return sys.stdin.isatty() and sys.stdout.isatty() and sys.stderr.isatty()


def _check_usage(args: argparse.Namespace) -> None:
    if args.watch and not args.json:
        raise UsageError("--watch needs --json")
    if args.pretty and not args.json:
        raise UsageError("--pretty needs --json")
    if args.once and args.json:
        raise UsageError("--once and --json are two different outputs: choose one")
    if args.demo and args.command:
        raise UsageError(f"--demo cannot be used with {args.command}")
    if args.record and (args.demo or args.command or args.once
                        or (args.json and not args.watch)):
        raise UsageError("--record goes with the board or --json --watch (to record "
                         "on its own: gputop record)")


#: The board's own outputs: before a subcommand they would be silently ignored.
_BOARD_OUTPUTS = ("--json", "--once", "--watch", "--pretty")


def _check_output_flags(args: argparse.Namespace, argv: Sequence[str]) -> None:
    if not args.command or args.command not in argv:
        return
    before = argv[: argv.index(args.command)]
    for flag in _BOARD_OUTPUTS:
        if flag in before:
            raise UsageError(f"{flag} before {args.command} does nothing: {args.command}'s "
                             f"options go after it (see gputop {args.command} --help)")


def _dispatch(args: argparse.Namespace) -> int:
    if args.command in NO_CONFIG_COMMANDS:
        from gputop import bootstrap

        return bootstrap.run(args)
    config = None if args.demo else _apply_overrides(load_config(args.config), args)
    if args.command:
        from gputop.commands import run_command

        assert config is not None
        return run_command(config, args)
    if args.json or args.once or not _on_terminal():
        with _fleet(config) as (cfg, sources):
            if args.demo:
                cfg = _apply_overrides(cfg, args)
            if args.json:
                return run_until_signal(
                    lambda: _json(cfg, sources, watch=args.watch, pretty=args.pretty,
                                  record=args.record), paced=args.watch)
            return run_until_signal(lambda: _table(cfg, sources))
    return _run_board(config, args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        _check_usage(args)
        _check_output_flags(args, argv)
        return _dispatch(args)
    except (ConfigError, UsageError, HistoryError) as exc:
        print(f"gputop: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``gputop --json --watch | head -1``): not an error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
