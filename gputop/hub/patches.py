"""What changed in a host, GPU by GPU, for readers that ask for patches.

A 200-host fleet whose GPUs all move makes every ``update`` carry every host complete:
about 950 kB each refresh, which each reader parses, checks and turns into its model
again, though per GPU only its load, memory, power and temperature moved. A reader that
opens the event stream with ``?patches=1`` gets ``patch`` events instead: a host whose
shape is the same (no error before or after, the same GPUs in the same places, the same
keys) comes as its changed keys and, per changed GPU, its position and changed keys with
their complete new values; any other host comes complete, as in an ``update``.
"""

from __future__ import annotations

from typing import Any

#: A host's keys a change never carries: its name says which host, its GPUs come apart.
FIXED = ("name", "gpus")


def host_change(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any] | None:
    """``{"name", "set", "gpus": [[position, {key: value}], ...]}`` turning ``old`` into
    ``new``; None when ``new`` must go complete (a new host, an error on either side,
    GPUs added, gone, moved or with other keys)."""
    if (old is None or old.keys() != new.keys() or old.get("error") is not None
            or new.get("error") is not None):
        return None
    was, now = old["gpus"], new["gpus"]
    if len(was) != len(now):
        return None
    gpus: list[list[Any]] = []
    for i, (a, b) in enumerate(zip(was, now)):
        if a is b or a == b:
            continue
        if a.keys() != b.keys() or a.get("uuid") != b.get("uuid"):
            return None
        gpus.append([i, {k: v for k, v in b.items() if a[k] != v}])
    return {"name": new["name"],
            "set": {k: v for k, v in new.items() if k not in FIXED and old[k] != v},
            "gpus": gpus}
