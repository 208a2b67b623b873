"""The headless writer: one JSON document per snapshot, one per line in ``--watch``.

``ensure_ascii`` keeps every non-ASCII or control character of remote text as a ``\\u``
escape, so a hostile process name cannot reach the reader's terminal through ``--json``.
"""

from __future__ import annotations

import json
from typing import IO, Any


def dumps(document: Any, *, pretty: bool = False) -> str:
    return json.dumps(document, ensure_ascii=True, indent=2 if pretty else None,
                      separators=None if pretty else (",", ":"))


def write_document(document: dict[str, Any], stream: IO[str], *, pretty: bool = False) -> None:
    write_line(dumps(document, pretty=pretty), stream)


def write_line(text: str, stream: IO[str]) -> None:
    stream.write(text + "\n")
    stream.flush()
