"""One error type and one exit-code table for every command.

Every refusal or failure a user can cause is a :class:`GputopError`: its ``exit_code`` says
what a script does next and its ``reason`` (a short word) says what happened, for callers
that must tell refusals apart without reading their text (MCP's tools). ``main`` catches
it once. The table below is the only place exit codes are described: ``gputop --help``
and docs/exit-codes.md are made from it (a test compares them).
"""

from __future__ import annotations

from dataclasses import dataclass

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_ERROR = 2
#: ``--json``/``--once`` where every host failed: a script can tell "all down" from data.
EXIT_NO_HOST = 3
#: The hub a reader was pointed at could not be read: one classified line, no output.
EXIT_HUB = 4
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class ExitCode:
    code: int
    #: The few words ``gputop --help`` gives it.
    short: str
    #: What docs/exit-codes.md says of it (markdown).
    meaning: str


EXIT_CODES: tuple[ExitCode, ...] = (
    ExitCode(EXIT_OK, "done", "done"),
    ExitCode(EXIT_REFUSED, "refused (conflict, nothing free, file exists)",
             "refused: a reservation conflict, a GPU a waiter in the queue could use, fewer "
             "free GPUs than `--count`, `--max-wait` ran out, your place in the queue was "
             "removed, `init-config` over an existing file"),
    ExitCode(EXIT_ERROR, "usage, config or store error",
             "usage, config, reservations-file or history-database error; a request no host "
             "can ever meet (`free --wait --count 3` where no host set has 3, or more GPUs "
             "than the known GPUs of the hosts that answer), or one that "
             "stopped being possible while it waited; a command whose extra is not installed "
             "(`gputop mcp` without `gputop[mcp]`, `gputop serve` without `gputop[hub]`: the "
             "line says what to install)"),
    ExitCode(EXIT_NO_HOST, "--json/--once/free: no host answered (the output says why for "
             "each)",
             "`--json` or `--once` where no host answered: the document or table is still "
             "written, each host with its reason (one host answering is enough for `0`); "
             "`free`, `free --share` and `run` where none of the hosts they asked answered "
             "(nothing is known to be free: it says which and why, where `1` would say none "
             "is), and a waiter (`--wait`) that reached none of its hosts for two minutes and "
             "left the queue"),
    ExitCode(EXIT_HUB, "the hub (--hub, [hub] url) is down or answered garbage",
             "the hub (`--hub`, `[hub] url`) is down or answered garbage: one line saying "
             "which (`unreachable`, `timeout`, `auth`, `parse`, `error`), nothing on stdout "
             "(docs/hub.md)"),
    ExitCode(EXIT_INTERRUPTED, "interrupted (143 SIGTERM, 129 SIGHUP)",
             "interrupted (ctrl+c, SIGINT)"),
    ExitCode(143, "", "SIGTERM"),
    ExitCode(129, "", "SIGHUP (the terminal closed)"),
)


def help_epilog() -> str:
    """The exit codes in one line, for ``gputop --help``."""
    return "Exit codes: " + ", ".join(f"{e.code} {e.short}" for e in EXIT_CODES
                                      if e.short) + "."


def docs_table() -> str:
    """The exit codes as docs/exit-codes.md's table."""
    rows = "\n".join(f"| `{e.code}` | {e.meaning} |" for e in EXIT_CODES)
    return "| code | meaning |\n|---|---|\n" + rows + "\n"


class GputopError(Exception):
    """A failure or refusal reported in one line (``gputop: ...``) with ``exit_code``.

    ``reason`` is machine-readable: each subclass has its own default, and a raise site
    may name a narrower one (``Refused(..., reason="queue")``).
    """

    exit_code: int = EXIT_ERROR
    reason: str = "error"

    def __init__(self, message: str = "", *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class UsageError(GputopError):
    """A bad command line or argument: reported in one line, exit 2."""

    reason = "usage"
