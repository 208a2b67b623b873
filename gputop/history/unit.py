"""The shipped systemd user unit for ``gputop record``, filled in for this install.

``gputop record --print-unit > ~/.config/systemd/user/gputop-record.service`` works however
gputop was installed (pipx, uv tool, a venv, ``pip --user``): the unit runs the very
``gputop`` that printed it, where copying the file out of the package needed a ``python3``
that can import gputop, which a pipx or venv install does not give.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

UNIT = Path(__file__).resolve().parent / "gputop-record.service"
_QUOTE = set(' \t"\'\\;')


def exec_word(word: str, *, program: bool = False) -> str:
    """One word of ``ExecStart=``: systemd expands ``%`` specifiers everywhere and ``$``
    variables in the arguments (not in the program's path) and splits at spaces, so a word
    holding any of them is escaped and quoted."""
    if any(ord(c) < 32 or ord(c) == 127 for c in word):
        raise ValueError(f"cannot put {word!r} in a systemd unit (a control character)")
    word = word.replace("%", "%%")
    if not program:
        word = word.replace("$", "$$")
    if not word or any(c in _QUOTE for c in word):
        word = '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word


def unit_text(command: Sequence[str]) -> str:
    """The shipped unit with ``ExecStart=`` running ``command`` (absolute paths)."""
    out = []
    for line in UNIT.read_text(encoding="utf-8").splitlines():
        if line.startswith("ExecStart="):
            line = "ExecStart=" + " ".join(exec_word(w, program=i == 0)
                                           for i, w in enumerate(command))
        elif line.startswith("# Adjust to where gputop is installed"):
            line = "# Written by `gputop record --print-unit` for the gputop installed here."
        out.append(line)
    return "\n".join(out) + "\n"
