"""The snapshot schema as checking functions: what a hub sends, checked and cleaned.

``gputop/schema/snapshot.schema.json`` is compiled once into one small function per part
(a host, a GPU, a process, ...), so checking a 200-host document walks it once with no
schema lookups on the way (the first, interpreted version spent 70 ms on a 950 kB
document, most of a board's cost of reading a hub; this one about a fifth of that). The
subset the schema uses: ``$ref`` to ``$defs``, ``type``, ``const``, ``enum``,
``pattern``, ``oneOf``, ``required``, ``properties``, ``additionalProperties: false``
and ``items``. On top of the schema: strings are cleaned (``gputop.text.clean``) and
bounded, numbers must be finite and integers fit 64 bits, arrays are bounded, and a
value of an unchecked part (an open object's extra key) must be plain JSON of bounded
depth. A failure is ``SchemaError`` naming where (``$.hosts[3].gpus[0].index``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Any, cast

from gputop.text import clean, excerpt

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schema" / "snapshot.schema.json"
MAX_STRING = 64 * 1024
MAX_ITEMS = 100_000
MAX_DEPTH = 32
MAX_INT = 2**63

Check = Callable[[Any], Any]


class SchemaError(ValueError):
    """What a hub sent does not check out; ``str`` says where and why."""

    def __init__(self, why: str, where: str = "") -> None:
        super().__init__(f"{where}: {why}" if where else why)
        self.why, self.where = why, where

    def under(self, step: str) -> SchemaError:
        return SchemaError(self.why, step + self.where)


@cache
def schema() -> dict[str, Any]:
    return cast(dict[str, Any], json.loads(SCHEMA_PATH.read_text(encoding="utf-8")))


def _string(v: Any) -> str:
    if type(v) is not str:
        raise SchemaError("expected a string")
    if len(v) > MAX_STRING:
        raise SchemaError(f"longer than {MAX_STRING} characters")
    return v if v.isprintable() else clean(v)


def _integer(v: Any) -> int:
    if type(v) is not int:
        raise SchemaError("expected an integer")
    if not -MAX_INT < v < MAX_INT:
        raise SchemaError("an integer out of range")
    return v


def _number(v: Any) -> float | int:
    t = type(v)
    if t is int:
        return _integer(v)
    if t is not float or not math.isfinite(v):
        raise SchemaError("expected a finite number")
    return cast(float, v)


def _boolean(v: Any) -> bool:
    if type(v) is not bool:
        raise SchemaError("expected true or false")
    return v


def _null(v: Any) -> None:
    if v is not None:
        raise SchemaError("expected null")


def _plain(v: Any, depth: int = 0) -> Any:
    """Any JSON value, strings cleaned, bounded in depth and size."""
    if depth > MAX_DEPTH:
        raise SchemaError("nested too deep")
    t = type(v)
    if t is str:
        return _string(v)
    if t is int:
        return _integer(v)
    if t is float:
        return _number(v)
    if v is None or t is bool:
        return v
    if t is list:
        if len(v) > MAX_ITEMS:
            raise SchemaError(f"more than {MAX_ITEMS} items")
        return [_plain(x, depth + 1) for x in v]
    if t is dict:
        return {_string(k): _plain(x, depth + 1) for k, x in v.items()}
    raise SchemaError("not JSON")


_SCALARS: dict[str, Check] = {"string": _string, "integer": _integer, "number": _number,
                              "boolean": _boolean, "null": _null}
_PY_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
             "null": type(None), "array": list, "object": dict}


class _Compiler:
    def __init__(self, root: Mapping[str, Any]) -> None:
        self.defs = root.get("$defs", {})
        self.done: dict[str, Check] = {}

    def ref(self, name: str) -> Check:
        if name not in self.done:
            slot: list[Check] = []
            self.done[name] = lambda v: slot[0](v)  # (a cycle resolves through the slot)
            slot.append(self.part(self.defs[name]))
            self.done[name] = slot[0]
        return self.done[name]

    def part(self, s: Mapping[str, Any]) -> Check:
        if "$ref" in s:
            ref = s["$ref"]
            assert ref.startswith("#/$defs/"), ref
            return self.ref(ref[len("#/$defs/"):])
        if "oneOf" in s:
            return self.one_of([self.part(o) for o in s["oneOf"]])
        if "const" in s:
            const = s["const"]
            base = self.typed(s)

            def is_const(v: Any) -> Any:
                if v != const or type(v) is not type(const):
                    raise SchemaError(f"expected {const!r}")
                return base(v)
            return is_const
        if "enum" in s:
            allowed = list(s["enum"])

            def in_enum(v: Any) -> Any:
                if type(v) not in (str, int, type(None)) or v not in allowed:
                    raise SchemaError("not one of the known values")
                return v
            return in_enum
        return self.typed(s)

    def one_of(self, options: list[Check]) -> Check:
        def first(v: Any) -> Any:
            for option in options:
                try:
                    return option(v)
                except SchemaError:
                    continue
            raise SchemaError("matches none of the allowed forms")
        return first

    def typed(self, s: Mapping[str, Any]) -> Check:
        t = s.get("type")
        types = t if isinstance(t, list) else [t] if t else []
        if "properties" in s or types == ["object"]:
            return self.obj(s)
        if types == ["array"]:
            return self.array(self.part(s.get("items", {})))
        if not types:
            return _plain
        if types == ["string"] and "pattern" in s:
            pattern = re.compile(s["pattern"])

            def matched(v: Any) -> str:
                text = _string(v)
                if not pattern.search(text):
                    raise SchemaError("not in the expected form")
                return text
            return matched
        if len(types) == 1:
            return _SCALARS[types[0]]
        by_type = {_PY_TYPES[x]: _SCALARS[x] for x in types if x in _SCALARS
                   and not isinstance(_PY_TYPES[x], tuple)}
        if "number" in types:
            by_type[int] = _integer
            by_type[float] = _number
        names = " or ".join(types)

        def any_of(v: Any) -> Any:
            check = by_type.get(type(v))
            if check is None:
                raise SchemaError(f"expected {names}")
            return check(v)
        return any_of

    def array(self, item: Check) -> Check:
        def items(v: Any) -> list[Any]:
            if type(v) is not list:
                raise SchemaError("expected an array")
            if len(v) > MAX_ITEMS:
                raise SchemaError(f"more than {MAX_ITEMS} items")
            out = []
            for i, x in enumerate(v):
                try:
                    out.append(item(x))
                except SchemaError as exc:
                    raise exc.under(f"[{i}]") from None
            return out
        return items

    def obj(self, s: Mapping[str, Any]) -> Check:
        props = {k: self.part(p) for k, p in s.get("properties", {}).items()}
        required = tuple(s.get("required", ()))
        closed = s.get("additionalProperties") is False

        def fields(v: Any) -> dict[str, Any]:
            if type(v) is not dict:
                raise SchemaError("expected an object")
            for k in required:
                if k not in v:
                    raise SchemaError(f"missing {k!r}")
            out = {}
            for k, x in v.items():
                check = props.get(k)
                if check is None:
                    if closed:
                        raise SchemaError(f"unknown key {excerpt(str(k), 40)!r}")
                    check = _plain
                try:
                    out[k] = check(x)
                except SchemaError as exc:
                    raise exc.under(f".{k}") from None
            return out
        return fields


@cache
def checker(part: str = "") -> Check:
    """The check for the whole document (``""``), one of its top-level keys
    (``"hosts"``, ``"queue"``, ...) or one of its ``$defs`` (``"#host"``)."""
    c = _Compiler(schema())
    if part.startswith("#"):
        return c.ref(part[1:])
    if part:
        return c.part(schema()["properties"][part])
    return c.part(schema())


def check(value: Any, part: str = "", where: str = "$") -> Any:
    try:
        return checker(part)(value)
    except SchemaError as exc:
        raise exc.under(where) from None
    except RecursionError:
        raise SchemaError("nested too deep", where) from None
