"""The ``gputop`` command: options, checks and dispatch. The board (Textual) is imported only
when it is shown, so ``--json``, ``--once`` and the reservation commands never load it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from gputop import __version__
from gputop.cli.headless import fleet, json_output, table_output
from gputop.cli.lifecycle import run_until_signal
from gputop.cli.options import (
    ALL,
    FLAGS,
    DemoFirst,
    Parser,
    demo_refusal,
    for_command,
    for_subcommand,
    global_options,
)
from gputop.cli.subcommands import add_subcommands
from gputop.config.load import Config, default_config_path, load_config
from gputop.config.values import hub_url_problem
from gputop.errors import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    GputopError,
    UsageError,
    help_epilog,
)
from gputop.reservations.ops import Refused

#: Subcommands that run before (and without) loading the hosts file.
NO_CONFIG_COMMANDS = ("init-config", "completion")

def _parser() -> argparse.ArgumentParser:
    # No abbreviations of the board's options: argparse would look for them in every
    # argument, a subcommand's too (`report --t` refused as --timeout or --theme), and one
    # before a subcommand slipped past the check that refuses them there (`--js free`).
    p = Parser(
        prog="gputop", root=True, allow_abbrev=False,
        description="One live board of every GPU on your team's servers.",
        epilog=help_epilog(),
        parents=[global_options(sub=False)],
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
    p.add_argument("--demo", action=DemoFirst,
                   help="a built-in simulated fleet (no SSH, no GPU needed): the board, "
                   "--json or --once")
    p.add_argument("--record", action="store_true",
                   help="board or --json --watch: also record every refresh into the history "
                   "database ([history] path), like `gputop record`")

    sub = add_subcommands(p)
    c = sub.add_parser("init-config", parents=for_subcommand("init-config"),
                       help="write the documented example hosts file to the config path "
                       "(never overwrites)",
                       description="Write the documented example hosts file (every key, "
                       "commented) to --config FILE, else $GPUTOP_CONFIG, else "
                       f"{default_config_path()} (your user config directory, which "
                       "$XDG_CONFIG_HOME sets on Linux); never over an existing file (exit "
                       "1). Edit its [[hosts]], then run gputop.")
    c.add_argument("--stdout", action="store_true", help="print it instead of writing it")
    c = sub.add_parser("completion", parents=for_subcommand("completion"),
                       help="print a shell completion script: bash, zsh or fish",
                       description="Print a completion script for bash, zsh or fish: "
                       "subcommands, options, host names and HOST:GPU from your config. "
                       'bash: eval "$(gputop completion bash)" in ~/.bashrc; zsh: the same '
                       "in ~/.zshrc; fish: gputop completion fish > "
                       "~/.config/fish/completions/gputop.fish")
    c.add_argument("shell", nargs="?", choices=("bash", "zsh", "fish"))
    c.add_argument("--candidates", choices=("hosts", "targets", "mine"),
                   help=argparse.SUPPRESS)  # what the scripts call back for
    return p

def _apply_overrides(config: Config, args: argparse.Namespace) -> Config:
    from dataclasses import replace

    if args.interval is not None:
        if args.interval < 0.1:
            raise UsageError("--interval must be at least 0.1 seconds")
        config = config.with_defaults(interval=args.interval)
    if args.timeout is not None:
        if args.timeout < 0.5:
            raise UsageError("--timeout must be at least 0.5 seconds")
        config = config.with_defaults(timeout=args.timeout)
    if getattr(args, "wait_all", False):
        config = config.with_defaults(wait_all=True)
    if getattr(args, "hub", None) is not None:
        problem = hub_url_problem(args.hub)
        if problem:
            raise UsageError(f"--hub {problem}")
        config = config.with_hub(url=args.hub)
    if config.hub.url is not None and config.implicit:
        config = replace(config, hosts=())  # no hosts file: the hub's hosts, all of them
    return config

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
        raise UsageError(demo_refusal(args.command))
    if args.record and args.demo:
        raise UsageError("--record records your hosts, not the demo's simulated fleet "
                         "(gputop --record, or gputop record)")
    if args.record and (args.command or args.once or (args.json and not args.watch)):
        raise UsageError("--record goes with the board or --json --watch (to record "
                         "on its own: gputop record)")

#: The board's own outputs: before a subcommand they would be silently ignored.
_BOARD_OUTPUTS = ("--json", "--once", "--watch", "--pretty")

def _command_at(argv: Sequence[str], command: str) -> int | None:
    """Where the subcommand is in ``argv``: the first word that is neither an option nor
    a global option's value (``--config reservations reservations``: the second)."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word in ALL and word not in FLAGS:  # (each takes a value: the next word)
            i += 2
            continue
        if word == command:
            return i
        if not word.startswith("-"):
            return None
        i += 1
    return None

def _check_output_flags(args: argparse.Namespace, argv: Sequence[str]) -> None:
    at = _command_at(argv, args.command) if args.command else None
    if at is None:
        return
    before = argv[:at]
    for flag in _BOARD_OUTPUTS:
        if flag in before:
            raise UsageError(f"{flag} before {args.command} does nothing: {args.command}'s "
                             f"options go after it (see gputop {args.command} --help)")
    # A global option the subcommand does not use (`--hub URL reservations`) was taken
    # before it and ignored, and refused after it: refused in both places.
    takes = for_command(args.command)
    for word in before:
        flag = word.split("=", 1)[0]
        if flag in ALL and flag not in takes:
            raise UsageError(f"{flag} does nothing for {args.command}, which takes "
                             f"{', '.join(takes)} (see gputop {args.command} --help)")

def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "serve" and args.print_shipped:  # (a file of gputop's: no config)
        from gputop.cli.serve import print_shipped

        return print_shipped(args.print_shipped)
    if args.command == "serve" and args.serve_demo:  # (no hosts file read: the demo's own)
        if args.config is not None:
            raise UsageError("serve --demo serves the simulated fleet and reads no hosts "
                             "file: drop --config (or --demo)")
        from gputop.cli.serve import serve_demo

        return serve_demo(args, lambda demo: _apply_overrides(demo, args))
    if args.command in NO_CONFIG_COMMANDS:
        from gputop.cli import bootstrap

        return bootstrap.run(args)
    config = None if args.demo else _apply_overrides(load_config(args.config), args)
    if args.command:
        from gputop.cli.subcommands import run_command

        assert config is not None
        return run_command(config, args)
    if args.json or args.once or not _on_terminal():
        with fleet(config) as (cfg, sources):
            if args.demo:
                cfg = _apply_overrides(cfg, args)
            if args.json:
                return run_until_signal(
                    lambda: json_output(cfg, sources, watch=args.watch, pretty=args.pretty,
                                  record=args.record), paced=args.watch)
            return run_until_signal(lambda: table_output(cfg, sources))
    return _run_board(config, args)

def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
        _check_usage(args)
        _check_output_flags(args, argv)
        return _dispatch(args)
    except GputopError as exc:
        prefix = "refused: " if isinstance(exc, Refused) else ""
        print(f"gputop: {prefix}{exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``gputop --json --watch | head -1``): not an error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
