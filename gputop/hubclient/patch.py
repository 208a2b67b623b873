"""Reading a hub's ``patch`` events (``/api/v1/events?patches=1``, see the hub's
``patches.py``): each changed host as its changed keys and, per changed GPU, its position
and changed keys.

A patch is checked as strictly as a complete host: every key must be one the schema
knows for a host (not ``name`` or ``gpus``) or a GPU, and every value passes that key's own
check from ``gputop.hubclient.hosts``; what a check cleans is the cleaned value. It is
applied whole or not at all: a patch for a host the reader does not have, or for a GPU
position it does not have, is a broken stream found before anything is applied (the
reader then starts again from a snapshot). Only the changed GPUs are checked and become
the model again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gputop.hubclient.hosts import GPU_FIELDS, GPU_PLAIN_NUMBERS, HOST_FIELDS
from gputop.hubclient.schema import MAX_INT, MAX_ITEMS, SchemaError
from gputop.text import excerpt

#: (host dict, its GPUs' changed keys by position; None: the host came complete)
Touched = tuple[dict[str, Any], dict[int, dict[str, Any]] | None]

_CHANGE_KEYS = frozenset({"name", "set", "gpus"})
_HOST_SET = {k: c for k, c in HOST_FIELDS.items() if k not in ("name", "gpus")}


def _fields(value: Any, checks: dict[str, Any]) -> dict[str, Any]:
    """The object's keys checked; the object itself unless a check cleaned a value (a
    parsed patch is the reader's own: at 200 x 8 a copy of each was 900 dicts a refresh).
    A failure names where from the object down (the caller adds where the object is)."""
    if type(value) is not dict:
        raise SchemaError("expected an object")
    out = value
    for k, v in value.items():
        check = checks.get(k)
        if check is None:
            raise SchemaError(f"unknown key {excerpt(str(k), 40)!r}")
        try:
            w = check(v)
        except SchemaError as exc:
            raise exc.under(f".{k}") from None
        except RecursionError:
            raise SchemaError("nested too deep", f".{k}") from None
        if w is not v:
            if out is value:
                out = dict(value)
            out[k] = w
    return out


def _gpu_fields(value: Any) -> dict[str, Any]:
    """``_fields(value, GPU_FIELDS)``, with the numbers most GPU patches hold (load,
    memory, temperature, power) checked inline, as ``hub_hosts._object`` checks them; any
    other key, or a number that fails inline, gets the key's own check (which names the
    failure)."""
    if type(value) is not dict:
        raise SchemaError("expected an object")
    plain = GPU_PLAIN_NUMBERS
    for k, v in value.items():
        floats = plain.get(k)
        if floats is None or not (
                v is None or (type(v) is int and -MAX_INT < v < MAX_INT)
                or (floats and type(v) is float and math.isfinite(v))):
            return _fields(value, GPU_FIELDS)
    return value


def _change(value: Any, where: str) -> dict[str, Any]:
    if type(value) is not dict or value.keys() != _CHANGE_KEYS:
        raise SchemaError("expected the keys gpus, name, set", where)
    name = value["name"]
    if type(name) is not str:
        raise SchemaError("expected a string", f"{where}.name")
    gpus = value["gpus"]
    if type(gpus) is not list or len(gpus) > MAX_ITEMS:
        raise SchemaError(f"expected an array of at most {MAX_ITEMS} items", f"{where}.gpus")
    out_gpus = []
    for i, item in enumerate(gpus):  # (where it is is spelt out only for a failure)
        if type(item) is not list or len(item) != 2:
            raise SchemaError("expected [position, object]", f"{where}.gpus[{i}]")
        pos = item[0]
        if type(pos) is not int or not 0 <= pos < MAX_ITEMS:
            raise SchemaError("expected a position", f"{where}.gpus[{i}]")
        try:
            out_gpus.append((pos, _gpu_fields(item[1])))
        except SchemaError as exc:
            raise exc.under(f"{where}.gpus[{i}]") from None
    try:
        host_set = _fields(value["set"], _HOST_SET)
    except SchemaError as exc:
        raise exc.under(f"{where}.set") from None
    return {"name": name, "set": host_set, "gpus": out_gpus}


def check_changes(changes: Any) -> list[dict[str, Any]]:
    """A ``patch`` event's ``changes``, checked (the rest of it is an ``update``'s)."""
    if type(changes) is not list or len(changes) > MAX_ITEMS:
        raise SchemaError(f"expected an array of at most {MAX_ITEMS} items", "patch.changes")
    return [_change(c, f"patch.changes[{i}]") for i, c in enumerate(changes)]


def check_places(host: Callable[[str], dict[str, Any] | None],
                 changes: list[dict[str, Any]]) -> None:
    """Every change names a host (``host(name)``: as it will be when the changes apply)
    and GPU positions it has: checked before anything is applied, so a patch is applied
    whole or not at all."""
    for c in changes:
        name = c["name"]
        was = host(name)
        if was is None:
            raise SchemaError(f"a patch for a host not in the document: {excerpt(name, 40)!r}")
        n = len(was["gpus"])
        for pos, _fields in c["gpus"]:
            if pos >= n:
                raise SchemaError(f"a patch for GPU position {pos} of {excerpt(name, 40)!r}, "
                              f"which lists {n}")


def apply_changes(hosts: dict[str, dict[str, Any]],
                  changes: list[dict[str, Any]]) -> list[Touched]:
    """Apply checked changes (``check_changes``, and ``check_places`` against these
    hosts) to ``hosts`` (by name), in place: nothing can fail once they are checked, and
    the reader's host objects are its own (copying each changed host and GPU was 900
    objects a refresh at 200 x 8); returns what each touched.

    A patch costs its length: a hostile one of 100,000 changes for one GPU merges at most
    the GPU's few dozen keys per change."""
    touched: dict[str, tuple[dict[str, Any], dict[int, dict[str, Any]]]] = {}
    for c in changes:
        name = c["name"]
        had = touched.get(name)
        if had is None:
            had = touched[name] = (hosts[name], {})
        h, keys = had
        h.update(c["set"])  # (never "name" or "gpus": check_changes)
        gpus = h["gpus"]
        for pos, fields in c["gpus"]:
            gpus[pos].update(fields)
            mine = keys.get(pos)
            keys[pos] = fields if mine is None else {**mine, **fields}
    return list(touched.values())
