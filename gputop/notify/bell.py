"""A waiting command's own notice: the terminal bell and a desktop notification (OSC 9,
understood by iTerm2, kitty, WezTerm, Windows Terminal; OSC 777, by VTE terminals and
foot) when its GPUs are granted. Only ever to a terminal: escape sequences in a pipe or a
log file are noise.
"""

from __future__ import annotations

import re
from typing import TextIO

#: What a desktop notification may hold: no control characters (an ESC or BEL would end
#: the sequence early and let the rest reach the terminal), and no ';' (OSC 777's field
#: separator).
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f;]")
MAX_TEXT = 200


def _safe(text: str) -> str:
    return _UNSAFE.sub(" ", text)[:MAX_TEXT]


def desktop(title: str, body: str) -> str:
    """BEL, then the notification as OSC 9 and as OSC 777 (a terminal ignores the one it
    does not know)."""
    t, b = _safe(title), _safe(body)
    return f"\a\x1b]9;{t}: {b}\x07\x1b]777;notify;{t};{b}\x07"


def ring(stream: TextIO, title: str, body: str) -> bool:
    """Ring ``stream`` when it is a terminal; True when it did."""
    try:
        if not stream.isatty():
            return False
        stream.write(desktop(title, body))
        stream.flush()
    except (OSError, ValueError):
        return False
    return True
