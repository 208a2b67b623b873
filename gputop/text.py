"""Untrusted text made safe to show: process names, user names, notes, GPU names, errors.

They come from other people's machines. Terminal control sequences (C0, C1, ESC, DEL) and
bidirectional overrides are dropped (and lone surrogates, which JSON can carry and no
UTF-8 output can write), so a hostile name can neither retitle the terminal nor
reorder what is shown next to it. Markup safety is the renderer's job: the UI builds
``rich.text.Text`` objects from these strings and never parses them as markup.
"""

from __future__ import annotations

import re

_UNSAFE = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f"  # C0 (but \t, \n), DEL, C1
    "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"  # bidi marks, embeddings, isolates
    "\ud800-\udfff]"  # lone surrogates (JSON's \\ud800): no UTF-8 terminal can take one
)
_ESC_SEQ = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")


def clean(text: str | None, *, one_line: bool = True) -> str:
    """Printable form of untrusted text: escape sequences and control characters removed."""
    if not text:
        return ""
    if text.isprintable():  # the common case, exactly: every character removed below is not
        return text
    text = _ESC_SEQ.sub("", text)
    if one_line:
        text = text.replace("\t", " ").replace("\r", " ").replace("\n", " ")
    return _UNSAFE.sub("", text)


def excerpt(text: str, limit: int = 160) -> str:
    """A short, single-line, sanitised excerpt for error messages."""
    t = " ".join(clean(text).split())
    return t if len(t) <= limit else t[: limit - 1] + "…"
