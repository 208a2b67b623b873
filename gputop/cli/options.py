"""The global options (``--config``, ``--interval``, ``--timeout``, ``--theme``) and which of
them each subcommand takes, so that its ``--help`` lists only what it uses.

They work before or after the subcommand (``gputop reserve X --config F``); ``--theme`` is
the board's alone. The completion scripts offer the same sets.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

from gputop.config.load import default_config_path
from gputop.errors import UsageError

#: Every global option, in the order ``--help`` lists them.
ALL = ("--config", "--interval", "--timeout", "--wait-all", "--theme", "--hub")
#: Those of them that take no value.
FLAGS = ("--wait-all",)
#: What a subcommand takes when it is not named below: it reads the config and hosts.
DEFAULT = ("--config", "--interval", "--timeout")
#: ``--hub``: where a command reads the live GPUs (a hub instead of the hosts).
#: Per subcommand: ``--interval`` only where it loops (waits, records); ``--timeout``
#: where it asks hosts (a one-shot query, or the job check that ``ps``-es a job's host).
#: ``--wait-all`` where a command answers from one look at the hosts.
BY_COMMAND: dict[str, tuple[str, ...]] = {
    "reserve": ("--config", "--timeout", "--wait-all", "--hub"),
    "extend": ("--config", "--timeout", "--wait-all", "--hub"),
    "release": ("--config", "--timeout", "--hub"),
    "reservations": ("--config", "--timeout"),
    "free": ("--config", "--interval", "--timeout", "--wait-all", "--hub"),
    "run": ("--config", "--interval", "--timeout", "--wait-all", "--hub"),
    "serve": ("--config", "--interval", "--timeout"),
    "record": ("--config", "--interval", "--timeout"),
    "report": ("--config",),
    "notify": ("--config", "--interval", "--timeout"),
    "mcp": ("--config", "--interval", "--timeout", "--wait-all"),
    "init-config": ("--config",),
    "completion": ("--config",),
}


def for_command(name: str) -> tuple[str, ...]:
    return BY_COMMAND.get(name, DEFAULT)


def global_options(names: Sequence[str] = ALL, *, sub: bool, demo: bool = False
                   ) -> argparse.ArgumentParser:
    """A parent parser holding ``names``. In a subcommand they default to SUPPRESS, so they
    never undo what came before it (``gputop --config A reserve X``)."""
    p = argparse.ArgumentParser(add_help=False)
    kw: dict[str, Any] = {"default": argparse.SUPPRESS} if sub else {}
    if "--config" in names:
        p.add_argument("--config", metavar="FILE", **kw,
                       help=f"hosts file (default: $GPUTOP_CONFIG, else {default_config_path()})")
    if "--interval" in names:
        p.add_argument("--interval", type=float, metavar="SECONDS", **kw,
                       help="seconds between refreshes (overrides the config)")
    if "--timeout" in names:
        p.add_argument("--timeout", type=float, metavar="SECONDS", **kw,
                       help="per-host timeout for connect + one query (overrides the config)")
    if "--wait-all" in names:
        p.add_argument("--wait-all", action="store_true", **kw,
                       help="a one-shot look waits for every host up to its timeout, not "
                       "just until the first-answer deadline ([defaults] first_answer)")
    if "--hub" in names:
        p.add_argument("--hub", metavar="URL", **kw,
                       help="read the live GPUs from this hub (gputop serve) instead of "
                       "SSHing to every host (overrides [hub] url)")
    if "--theme" in names:
        p.add_argument("--theme", metavar="NAME", **kw,
                       help="board theme: gputop-dark, gputop-light, gputop-contrast or your "
                       "own")
    if sub and not demo:  # (demo: the subcommand has a --demo of its own)
        # Hidden: so that ``gputop free --demo`` gets the board's own refusal, which says
        # what the demo is and what subcommands need, not argparse's "unrecognized
        # arguments" (after ``run``'s command it is the command's own argument).
        p.add_argument("--demo", action=_DemoAfter)
    return p


#: Subcommands with a ``--demo`` of their own (after the subcommand).
OWN_DEMO = ("serve",)


def demo_refusal(command: str) -> str:
    if command in OWN_DEMO:
        return (f"--demo goes after {command}: gputop {command} --demo (a hub of the "
                "simulated fleet, its web board and /metrics)")
    return (f"--demo cannot be used with {command}: the simulated fleet is the board "
            "(gputop --demo; r reserves, Q queues there), --json or --once, and a hub of "
            "it (gputop serve --demo); subcommands need your hosts (gputop init-config)")


#: ``--demo`` came before the subcommand being parsed (``gputop --demo reserve``).
_DEMO_FIRST: ContextVar[bool] = ContextVar("demo_first", default=False)


class DemoFirst(argparse.Action):
    """The board's ``--demo``; noted, so that a subcommand after it is refused as the demo's
    mistake (``gputop --demo reserve``), not as a missing target."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=False, **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, True)
        _DEMO_FIRST.set(True)


class _DemoAfter(argparse.Action):
    """``--demo`` after a subcommand: refused as soon as it is read, before argparse could
    complain of a missing target (``gputop reserve --demo``)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        raise UsageError(demo_refusal(parser.prog.rsplit(" ", 1)[-1]))


class Parser(argparse.ArgumentParser):
    """argparse's parser, but a hidden option answers only to its whole name, so that it
    makes no abbreviation ambiguous (``report --d`` is still ``--db``, not ``--demo`` or
    ``--db``), and a subcommand's own error gives way to the demo's refusal after
    ``--demo``."""

    def __init__(self, *args: Any, root: bool = False, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.root = root  # the whole command's (its subcommands' parsers are not)

    def _get_option_tuples(self, option_string: str) -> Any:
        return [t for t in super()._get_option_tuples(option_string)
                if t[0].help is not argparse.SUPPRESS]

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if not self.root:  # a subcommand's parse, within the whole command's
            # What it does not know is its own error, with its own usage (`reserve X --for
            # 2 hours`): left to the whole command, it got gputop's usage instead.
            namespace, extras = super().parse_known_args(args, namespace)
            cmd = getattr(namespace, "cmd", None) or []  # run's command (all that is left)
            if cmd and "--" in cmd[1:] and _duration_hint(args, cmd[0]):
                extras = cmd[:cmd.index("--")]  # `run --for 2 hours -- CMD`: not the command
            if extras:
                self.error(f"unrecognized arguments: {' '.join(extras)}"
                           + _duration_hint(args, extras[0]))
            return namespace, extras
        token = _DEMO_FIRST.set(False)
        try:
            return super().parse_known_args(args, namespace)
        finally:
            _DEMO_FIRST.reset(token)

    def error(self, message: str) -> Any:
        if _DEMO_FIRST.get() and not self.root:
            raise UsageError(demo_refusal(self.prog.rsplit(" ", 1)[-1]))
        super().error(message)


#: A unit written as a word of its own after ``--for N``.
_UNIT_WORD = re.compile(r"(?i)(s|secs?|seconds?|m|mins?|minutes?|h|hrs?|hours?|d|days?|"
                        r"w|weeks?)")


def _duration_hint(args: Any, extra: str) -> str:
    """``--for 2 hours``: the unit is a word of its own, and ``--for 2`` alone would be
    two minutes."""
    words = list(args or ())
    if "--for" in words and _UNIT_WORD.fullmatch(extra):
        return " (--for takes one word, e.g. --for 2h, 90m or 1d; a bare number is minutes)"
    return ""


def for_subcommand(name: str) -> list[argparse.ArgumentParser]:
    """``parents=`` for subcommand ``name``'s parser."""
    return [global_options(for_command(name), sub=True, demo=name in OWN_DEMO)]
