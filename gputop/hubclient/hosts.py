"""The hot path of reading a hub: its host objects, checked by hand (cleaned, bounded).

Every update of a 200-host fleet carries every host that changed (all of them when every
GPU's load moves): the generic compiled check (``gputop.hubclient.schema``) spent about
12 ms of a 2 s interval on one, a board's largest cost of reading a hub. This is the same
check of the schema's ``host`` (and its ``gpu``, ``process``, ``instance``,
``reservation``, ``share``) written out per object: key sets compared as sets, fields
checked by kind from tables, a dict copied only where a string needed cleaning. It is as
strict as the schema (``tests/test_hub_check.py`` runs it against ``jsonschema`` on random
and hostile documents) and strict in the same ways on top as the compiled check: strings
bounded and cleaned, integers within 64 bits, numbers finite, open objects' extra values
plain JSON of bounded depth (their keys short printable text); and times must be ASCII
``YYYY-MM-DDTHH:MM:SSZ`` exactly (the schema's ``\\d`` and ``$`` also let other digits
and a trailing newline through).
A failure is ``SchemaError`` naming where, as the compiled check's do.
"""

from __future__ import annotations

import math
import re
from typing import Any

# The primitives are the document check's own (one definition of a string, an integer, ...)
from gputop.hubclient.schema import (
    MAX_INT,
    MAX_ITEMS,
    MAX_STRING,
    SchemaError,
    _boolean,
    _integer,
    _null,
    _plain,
    _string,
)
from gputop.text import excerpt

_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z", re.ASCII)
_TIMES: set[str] = set()  # times already seen to be well formed (a document shares a few)


def _time(v: Any) -> str:
    if type(v) is str and v in _TIMES:
        return v
    if type(v) is not str:
        raise SchemaError("expected a string")
    if not _TIME.fullmatch(v):
        raise SchemaError("not in the expected form")
    if len(_TIMES) > 4096:
        _TIMES.clear()
    _TIMES.add(v)
    return v


def _at_least(low: int) -> Any:
    def check(v: Any) -> int:
        n = _integer(v)
        if n < low:
            raise SchemaError(f"less than {low}")
        return n
    return check


def _int_or_null(v: Any) -> int | None:
    return None if v is None else _integer(v)


def _num_or_null(v: Any) -> float | int | None:
    if v is None:
        return None
    if type(v) is int:
        return _integer(v)
    if type(v) is not float or not math.isfinite(v):
        raise SchemaError("expected number or null")
    return v


def _str_or_null(v: Any) -> str | None:
    return None if v is None else _string(v)


def _enum(*values: str) -> Any:
    allowed = frozenset(values)

    def check(v: Any) -> str:
        if type(v) is not str or v not in allowed:
            raise SchemaError("not one of the known values")
        return v
    return check


def _array(item: Any) -> Any:
    def check(v: Any) -> list[Any]:
        if type(v) is not list:
            raise SchemaError("expected an array")
        if not v:
            return v
        if len(v) > MAX_ITEMS:
            raise SchemaError(f"more than {MAX_ITEMS} items")
        out = v
        for i, x in enumerate(v):
            try:
                y = item(x)
            except SchemaError as exc:
                raise exc.under(f"[{i}]") from None
            if y is not x:
                if out is v:
                    out = list(v)
                out[i] = y
        return out
    return check


def _strings(v: Any) -> list[str]:
    if type(v) is not list:
        raise SchemaError("expected an array")
    if len(v) > MAX_ITEMS:
        raise SchemaError(f"more than {MAX_ITEMS} items")
    for x in v:
        if type(x) is not str or len(x) > MAX_STRING or not x.isprintable():
            return _array(_string)(v)  # type: ignore[no-any-return]
    return v


def field_checks(fields: dict[str, Any], ints: tuple[str, ...] = (),
                 strs: tuple[str, ...] = (), nums: tuple[str, ...] = ()) -> dict[str, Any]:
    """Each known key's own check, as ``_object`` applies it to that key's value."""
    return {**{k: _int_or_null for k in ints}, **{k: _str_or_null for k in strs},
            **{k: _num_or_null for k in nums}, **fields}


def _object(fields: dict[str, Any], required: tuple[str, ...], *, closed: bool = True,
            ints: tuple[str, ...] = (), strs: tuple[str, ...] = (),
            nums: tuple[str, ...] = ()) -> Any:
    """The check of one kind of object: ``required`` keys first, in order (the first
    missing is named), then, if ``closed``, no key but the known; then each field's
    check. ``ints`` (integer or null), ``strs`` (string or null) and ``nums`` (number or
    null), most of a GPU's fields, are checked inline; only a field that fails that (a
    string to clean, an integer among numbers) is looked at by its own check."""
    need = frozenset(required)
    known = frozenset(fields) | frozenset(ints) | frozenset(strs) | frozenset(nums)
    each = field_checks(fields, ints, strs, nums)
    others = tuple(fields.items())

    def one(v: dict[str, Any], out: dict[str, Any], keys: Any) -> dict[str, Any]:
        for k in keys:
            if k in v:
                x = v[k]
                try:
                    y = each[k](x)
                except SchemaError as exc:
                    raise exc.under(f".{k}") from None
                if y is not x:
                    if out is v:
                        out = dict(v)
                    out[k] = y
        return out

    def check(v: Any) -> dict[str, Any]:
        if type(v) is not dict:
            raise SchemaError("expected an object")
        keys = v.keys()
        if not need <= keys:
            k = next(k for k in required if k not in v)
            raise SchemaError(f"missing {k!r}")
        if closed and not keys <= known:
            k = next(k for k in v if k not in known)
            raise SchemaError(f"unknown key {excerpt(str(k), 40)!r}")
        out = v
        get = v.get
        for k in ints:
            x = get(k)
            if x is not None and (type(x) is not int or not -MAX_INT < x < MAX_INT):
                out = one(v, out, (k,))
        for k in strs:
            x = get(k)
            if x is not None and (type(x) is not str or len(x) > MAX_STRING
                                  or not x.isprintable()):
                out = one(v, out, (k,))
        for k in nums:
            x = get(k)
            if x is not None and (type(x) is not float or not math.isfinite(x)):
                out = one(v, out, (k,))  # (an int, a NaN: on its own)
        for k, c in others:
            if k in v:
                x = v[k]
                try:
                    y = c(x)
                except SchemaError as exc:
                    raise exc.under(f".{k}") from None
                if y is not x:
                    if out is v:
                        out = dict(v)
                    out[k] = y
        if not closed and not keys <= known:
            for k in v:
                if k not in known:
                    if len(k) > 64 or not k.isprintable():  # (cleaned, it could name
                        raise SchemaError("a key that is not a short line of text")  # a field)
                    try:
                        x = v[k]
                        y = _plain(x)
                    except SchemaError as exc:
                        raise exc.under(f".{k}") from None
                    if y is not x:
                        if out is v:
                            out = dict(v)
                        out[k] = y
        return out
    return check


def _one_of_null(check: Any) -> Any:
    def either(v: Any) -> Any:
        return None if v is None else check(v)
    return either


_RESERVATION_FIELDS: dict[str, Any] = {
    "id": _string, "host": _string, "gpu": _integer, "instance": _integer,
    "share_mib": _at_least(1), "user": _string, "machine": _string, "created": _time,
    "expires": _time, "note": _string, "login": _string}
_RESERVATION_REQUIRED = ("id", "host", "gpu", "user", "created", "expires")
_reservation = _object(_RESERVATION_FIELDS, _RESERVATION_REQUIRED, closed=False,
                       strs=("uuid",))
_share = _object(
    {**_RESERVATION_FIELDS, "share_mib": _at_least(1), "seconds_left": _at_least(0),
     "flags": _array(_enum("over-share", "idle-reservation", "renumbered"))},
    (*_RESERVATION_REQUIRED, "share_mib", "used_mib", "seconds_left", "flags"),
    closed=False, ints=("used_mib",), strs=("uuid",))
_process = _object(
    {"pid": _integer}, ("pid", "user", "command", "gpu_memory_mib"),
    ints=("gpu_memory_mib", "elapsed_s", "gpu_instance_id", "compute_instance_id"),
    strs=("user", "command"))
_processes = _array(_process)
_FLAGS = ("unreserved-use", "idle-reservation", "idle-holder", "lost", "renumbered",
          "beyond-max")
_instance = _object(
    {"utilization_percent": _null, "reservation": _one_of_null(_reservation),
     "flags": _array(_enum(*_FLAGS)), "processes": _processes},
    ("gpu_instance_id", "compute_instance_id", "uuid", "profile", "memory_used_mib",
     "memory_total_mib", "utilization_percent", "processes"),
    ints=("gpu_instance_id", "compute_instance_id", "device_index", "memory_used_mib",
          "memory_total_mib"),
    strs=("uuid", "profile"))
_GPU_KINDS: dict[str, Any] = dict(
    fields={"lost": _boolean,
            "reservation": _one_of_null(_reservation),
            "flags": _array(_enum(*_FLAGS, "over-share")), "shares": _array(_share),
            "processes": _processes, "instances": _array(_instance)},
    ints=("index", "utilization_percent", "memory_utilization_percent", "memory_used_mib",
          "memory_total_mib", "temperature_c", "fan_percent", "unshared_mib"),
    strs=("uuid", "name", "bus_id", "pstate", "mig_mode", "persistence_mode",
          "driver_version", "lost_reason"),
    nums=("power_draw_w", "power_limit_w"))
_gpu = _object(
    required=("index", "uuid", "name", "utilization_percent", "memory_used_mib",
              "memory_total_mib", "temperature_c", "power_draw_w", "processes"),
    **_GPU_KINDS)
#: A GPU object's known keys, each with its check (a patch's changed keys: hub_patch.py).
GPU_FIELDS = field_checks(**_GPU_KINDS)
#: A GPU's keys whose check only ever passes a value as it is or fails, each with whether
#: a float is a value it passes (integer or null; number or null): a patch's load, memory
#: and power, which ``hub_patch`` checks inline.
GPU_PLAIN_NUMBERS: dict[str, bool] = {**dict.fromkeys(_GPU_KINDS["ints"], False),
                                      **dict.fromkeys(_GPU_KINDS["nums"], True)}
_error = _object({"kind": _enum("unreachable", "timeout", "auth", "host-key",
                                "no-nvidia-smi", "driver", "no-devices", "parse", "no-nvml",
                                "starting", "slow", "ssh", "error"), "message": _string},
                 ("kind", "message"))
_HOST_KINDS: dict[str, Any] = dict(
    fields={"name": _string, "status": _enum("ok", "error"), "error": _one_of_null(_error),
            "time": _time, "last_ok": _one_of_null(_time),
            "source": _enum("ssh", "nvml", "demo", "none"), "tags": _strings,
            "warnings": _strings, "gpus": _array(_gpu)},
    nums=("first_sample_s",))
host = _object(required=("name", "status", "error", "gpus"), **_HOST_KINDS)
#: A host object's known keys, each with its check.
HOST_FIELDS = field_checks(**_HOST_KINDS)
_hosts = _array(host)


def check_hosts(value: Any, where: str) -> list[dict[str, Any]]:
    """A document's (or an update's) ``hosts``, checked and cleaned."""
    try:
        return _hosts(value)  # type: ignore[no-any-return]
    except SchemaError as exc:
        raise exc.under(where) from None
    except RecursionError:
        raise SchemaError("nested too deep", where) from None
