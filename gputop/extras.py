"""The optional parts of gputop and what to install for each.

The core (the board, ``--json``, reservations, the queue, ``run``, history) needs only its
own dependencies; the servers are extras, so a laptop that only wants the board does not
install an agents' server. A command whose extra is missing says exactly what to install.
"""

from __future__ import annotations

from gputop.errors import GputopError

#: extra -> (what it serves, the modules it brings that gputop imports, pip requirement).
EXTRAS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "mcp": ("gputop mcp", ("mcp", "pydantic"), "mcp>=2.3,<3"),
    "hub": ("gputop serve", ("prometheus_client",), "prometheus-client>=0.17"),
}


class MissingExtra(GputopError):
    """An optional part is not installed: one line naming the extra to install. Exit 2."""

    reason = "missing-extra"

    def __init__(self, extra: str, exc: ImportError) -> None:
        what, _, requirement = EXTRAS[extra]
        module = exc.name or "a module"
        super().__init__(
            f"{what} needs the '{extra}' extra ({module} is not installed in gputop's "
            f"environment): in gputop's checkout, pip install '.[{extra}]' (or pipx install "
            f"--force '.[{extra}]'; uv tool install --force '.[{extra}]'); into an existing "
            f"pipx install, pipx inject gputop '{requirement}'")
        self.extra = extra


def require(extra: str) -> None:
    """Raise MissingExtra (one line, exit 2) unless ``extra``'s modules import: called
    before a command that needs them loads anything of them."""
    import importlib

    for module in EXTRAS[extra][1]:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise MissingExtra(extra, exc) from None
