"""The shipped systemd user units (``gputop record``, ``gputop serve``), filled in for
this install.

``gputop record --print-unit > ~/.config/systemd/user/gputop-record.service`` (and the same
for ``serve``) works however gputop was installed (pipx, uv tool, a venv, ``pip --user``):
the unit runs the very ``gputop`` that printed it, where copying the file out of the
package needed a ``python3`` that can import gputop, which a pipx or venv install does not
give.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gputop.errors import UsageError

if TYPE_CHECKING:
    from importlib.abc import Traversable

UNIT = Path(__file__).resolve().parent / "gputop-record.service"
_QUOTE = set(' \t"\'\\;')


def exec_word(word: str, *, program: bool = False) -> str:
    """One word of ``ExecStart=``: systemd expands ``%`` specifiers everywhere and ``$``
    variables in the arguments (not in the program's path) and splits at spaces, so a word
    holding any of them is escaped and quoted."""
    if any(ord(c) < 32 or ord(c) == 127 for c in word):
        raise UsageError(f"cannot put {word!r} in a systemd unit (a control character)")
    word = word.replace("%", "%%")
    if not program:
        word = word.replace("$", "$$")
    if not word or any(c in _QUOTE for c in word):
        word = '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word


def this_gputop(subcommand: str) -> list[str]:
    """``gputop SUBCOMMAND`` as a service runs it: this very gputop (the script on PATH, else
    this interpreter with ``-m gputop``)."""
    script = sys.argv[0] if sys.argv else ""
    if os.path.basename(script) == "gputop" and os.access(script, os.X_OK):
        return [os.path.abspath(script), subcommand]  # unresolved: pipx's ~/.local/bin link
    return [sys.executable, "-m", "gputop", subcommand]


def unit_text(command: Sequence[str], template: Traversable = UNIT) -> str:
    """The shipped unit ``template`` with ``ExecStart=`` running ``command`` (absolute
    paths); ``command``'s subcommand names the ``--print-unit`` that wrote it."""
    sub = next((w for w in command[1:] if w in ("record", "serve", "notify")), "record")
    sub = "notify run" if sub == "notify" else sub
    out = []
    for line in template.read_text(encoding="utf-8").splitlines():
        if line.startswith("ExecStart="):
            line = "ExecStart=" + " ".join(exec_word(w, program=i == 0)
                                           for i, w in enumerate(command))
        elif line.startswith("# Adjust to where gputop is installed"):
            line = f"# Written by `gputop {sub} --print-unit` for the gputop installed here."
        out.append(line)
    return "\n".join(out) + "\n"
