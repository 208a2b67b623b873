"""The headless writer: one JSON document per snapshot, one per line in ``--watch``.

``ensure_ascii`` keeps every non-ASCII or control character of remote text as a ``\\u``
escape, so a hostile process name cannot reach the reader's terminal through ``--json``.
"""

from __future__ import annotations

import json
from typing import IO, Any

#: The documents are trees built afresh from frozen records: no cycle to look for (which
#: costs the encoder a fifth of its time on a 200-host ``--watch`` line).
_COMPACT = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), check_circular=False)
_PRETTY = json.JSONEncoder(ensure_ascii=True, indent=2, check_circular=False)


def dumps(document: Any, *, pretty: bool = False) -> str:
    return (_PRETTY if pretty else _COMPACT).encode(document)


def write_document(document: dict[str, Any], stream: IO[str], *, pretty: bool = False) -> None:
    write_line(dumps(document, pretty=pretty), stream)


def write_line(text: str, stream: IO[str]) -> None:
    stream.write(text + "\n")
    stream.flush()
