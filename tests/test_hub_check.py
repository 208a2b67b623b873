"""The hand-written check of a hub's host objects (gputop.hubclient.hosts) against the
schema itself: ``jsonschema`` and it accept and refuse the same documents, random valid
ones and each of them broken at one random place with a hostile value; where they differ
it is only one of the bounds on top of the schema (integers within 64 bits, a float
where the schema's ``integer`` also takes 1.0, ASCII times without a trailing newline,
short printable keys). What it accepts, it returns exactly as the schema's compiled
check (gputop.hubclient.schema) does: strings cleaned the same way."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gputop.hubclient.client import check_document, check_update
from gputop.hubclient.hosts import check_hosts
from gputop.hubclient.schema import SchemaError, check
from gputop.text import clean

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "gputop" / "schema"
                     / "snapshot.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
T = "2026-12-01T18:06:13Z"
FLAGS = ["unreserved-use", "idle-reservation", "idle-holder", "lost", "renumbered",
         "beyond-max"]


def _maybe(r: random.Random, value: Any) -> Any:
    return None if r.random() < 0.2 else value


def _text(r: random.Random) -> str:
    return r.choice(["alice", "python train.py", "", "ünï", "a\x1b[31mred", "tab\there",
                     "\u202eevil", "x" * 50])


def _process(r: random.Random) -> dict[str, Any]:
    p: dict[str, Any] = {"pid": r.randrange(1, 99999), "user": _maybe(r, _text(r)),
                         "command": _maybe(r, _text(r)),
                         "gpu_memory_mib": _maybe(r, r.randrange(0, 80000))}
    for k in ("elapsed_s", "gpu_instance_id", "compute_instance_id"):
        if r.random() < 0.5:
            p[k] = _maybe(r, r.randrange(0, 100))
    return p


def _reservation(r: random.Random, share: bool = False) -> dict[str, Any]:
    v: dict[str, Any] = {"id": "r1", "host": "h", "gpu": r.randrange(8), "user": _text(r),
                         "created": T, "expires": T}
    for k, val in (("machine", "laptop"), ("note", _text(r)), ("login", "al"),
                   ("uuid", _maybe(r, "GPU-1")), ("instance", 1), ("extra", {"a": [1]})):
        if r.random() < 0.3:
            v[k] = val
    if share or r.random() < 0.2:
        v["share_mib"] = r.randrange(1, 9000)
    if share:
        v.update(used_mib=_maybe(r, 5), seconds_left=r.randrange(0, 99),
                 flags=r.sample(["over-share", "idle-reservation", "renumbered"],
                                r.randrange(3)))
    return v


def _gpu(r: random.Random) -> dict[str, Any]:
    g: dict[str, Any] = {
        "index": _maybe(r, r.randrange(8)), "uuid": _maybe(r, "GPU-x"),
        "name": _maybe(r, _text(r)), "utilization_percent": _maybe(r, r.randrange(101)),
        "memory_used_mib": _maybe(r, 100), "memory_total_mib": _maybe(r, 81559),
        "temperature_c": _maybe(r, 40), "power_draw_w": _maybe(r, r.choice([12.5, 300])),
        "processes": [_process(r) for _ in range(r.randrange(3))]}
    for k, val in (("bus_id", "00000000:01:00.0"), ("memory_utilization_percent", 3),
                   ("power_limit_w", 700.0), ("fan_percent", 30), ("pstate", "P0"),
                   ("mig_mode", "Enabled"), ("persistence_mode", "Disabled"),
                   ("driver_version", "550.90.07"), ("lost", False), ("lost_reason", "x"),
                   ("unshared_mib", 3)):
        if r.random() < 0.6:
            g[k] = _maybe(r, val) if k != "lost" else val
    if r.random() < 0.5:
        g["reservation"] = _maybe(r, _reservation(r))
    if r.random() < 0.5:
        g["flags"] = r.sample([*FLAGS, "over-share"], r.randrange(3))
    if r.random() < 0.3:
        g["shares"] = [_reservation(r, share=True) for _ in range(r.randrange(1, 3))]
    if r.random() < 0.3:
        g["instances"] = [{
            "gpu_instance_id": _maybe(r, 1), "compute_instance_id": _maybe(r, 0),
            "device_index": 0, "uuid": "MIG-1", "profile": "1g.10gb",
            "memory_used_mib": 1, "memory_total_mib": 9000, "utilization_percent": None,
            "processes": [_process(r)], "flags": r.sample(FLAGS, 1),
            "reservation": _maybe(r, _reservation(r))} for _ in range(r.randrange(1, 3))]
    return g


def _host(r: random.Random) -> dict[str, Any]:
    bad = r.random() < 0.2
    h: dict[str, Any] = {
        "name": _text(r) or "h", "status": "error" if bad else "ok",
        "error": {"kind": r.choice(["timeout", "auth", "starting"]), "message": _text(r)}
        if bad else None, "gpus": [] if bad else [_gpu(r) for _ in range(r.randrange(1, 4))]}
    for k, val in (("time", T), ("last_ok", _maybe(r, T)), ("source", "ssh"),
                   ("tags", ["a", _text(r)]), ("warnings", [_text(r)]),
                   ("first_sample_s", _maybe(r, r.choice([0.5, 2])))):
        if r.random() < 0.7:
            h[k] = val
    return h


#: Values that break a field, and (True) whether the schema alone may still take it.
HOSTILE: list[tuple[Any, bool]] = [
    (None, False), (True, False), (False, False), (0, False), (-1, False), (7, False),
    (2**63, True), (-(2**63), True), (2**70, True), (1.0, True), (1.5, False),
    (1e308, True), ("", False), ("x", False), ("\x1b]0;pwn\x07", False), ("a\nb", False),
    ([], False), ({}, False), ([1, "a"], False), ({"k": {"k": [None]}}, False),
    (T + "\n", True), ("\uff12\uff10\uff12\uff16-12-01T18:06:13Z", True),
    ("2026-12-01 18:06:13Z", False),
    ("ok", False), ("error", False), ("over-share", False), ("timeout", False),
    ("ssh", False), ([T], False), (["over-share"], False), ([{"pid": 1}], False),
]
ODD_KEYS: list[tuple[str, bool]] = [("bogus", False), ("no\x1bte", True), ("k" * 80, True),
                                    ("note", False), ("share_mib", False)]


def _places(v: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(v, dict):
        for k, x in v.items():
            out += _places(x, (*path, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out += _places(x, (*path, i))
    return out


def _break(r: random.Random, hosts: list[Any]) -> tuple[list[Any], bool, str]:
    """One hostile change somewhere in ``hosts``; whether the schema alone may take it."""
    hosts = copy.deepcopy(hosts)
    path = r.choice(_places(hosts)[1:])
    parent: Any = hosts
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    how = r.random()
    if how < 0.15 and isinstance(parent, dict):
        del parent[last]
        return hosts, False, f"{path} deleted"
    if how < 0.3 and isinstance(parent, dict):
        key, lax = r.choice(ODD_KEYS)
        parent[key] = r.choice(["x", 1, None, [1]])
        return hosts, lax, f"{path[:-1]} + {key!r}"
    value, lax = r.choice(HOSTILE)
    parent[last] = copy.deepcopy(value)
    return hosts, lax, f"{path} = {value!r}"


def _schema_takes(hosts: list[Any]) -> bool:
    return bool(VALIDATOR.is_valid({"version": 5, "time": T, "hosts": hosts}))


def _ours(hosts: list[Any]) -> Any:
    try:
        return check_hosts(copy.deepcopy(hosts), "$.hosts")
    except SchemaError as exc:
        return exc


@pytest.mark.parametrize("seed", range(4))
def test_the_hand_written_check_takes_and_refuses_what_the_schema_does(seed: int) -> None:
    r = random.Random(seed)
    refused = 0
    for _ in range(300):
        hosts = [_host(r) for _ in range(r.randrange(1, 3))]
        assert _schema_takes(hosts)
        ours = _ours(hosts)
        assert not isinstance(ours, SchemaError), (ours, hosts)
        assert ours == check(copy.deepcopy(hosts), "hosts")  # cleaned the same way
        assert "\x1b" not in json.dumps(ours) and "\\u202e" not in json.dumps(ours)
        broken, lax, what = _break(r, hosts)
        schema, mine = _schema_takes(broken), _ours(broken)
        if not isinstance(mine, SchemaError):
            assert schema, what  # never takes what the schema refuses
        elif schema:
            assert lax, (what, str(mine))  # refuses what the schema takes: a bound on top
        refused += isinstance(mine, SchemaError)
    assert refused > 200  # (most hostile changes are refused: the test bites)


def test_odd_lines_first_middle_last_name_where() -> None:
    r = random.Random(9)
    hosts = [_host(r) for _ in range(5)]
    hosts = [h for h in hosts if h["gpus"]] or [_host(r)]
    for i in (0, len(hosts) // 2, len(hosts) - 1):
        broken = copy.deepcopy(hosts)
        broken[i]["gpus"][-1]["utilization_percent"] = "50"
        with pytest.raises(SchemaError) as exc:
            check_hosts(broken, "$.hosts")
        n = len(broken[i]["gpus"]) - 1
        assert str(exc.value).startswith(f"$.hosts[{i}].gpus[{n}].utilization_percent: ")


def test_strings_cleaned_and_bounded_keys_refused() -> None:
    h = _host(random.Random(1))
    h.update(name="a\x1b[2Jb\nc", status="ok", error=None, gpus=[])
    out = check_hosts([h], "$.hosts")[0]
    assert out["name"] == clean("a\x1b[2Jb\nc") == "ab c"
    deep: Any = 1
    for _ in range(100):
        deep = [deep]
    g = _gpu(random.Random(2))
    g["reservation"] = {**_reservation(random.Random(3)), "extra": deep}
    with pytest.raises(SchemaError, match="nested too deep"):
        check_hosts([{"name": "h", "status": "ok", "error": None, "gpus": [g]}], "$.hosts")


def test_documents_and_updates_go_through_it() -> None:
    r = random.Random(4)
    hosts = [_host(r) for _ in range(3)]
    for i, h in enumerate(hosts):  # (a document names each host once)
        h["name"] = f"h{i}"
    doc = {"version": 5, "time": T, "hosts": hosts, "queue": []}
    assert check_document(copy.deepcopy(doc))["hosts"] == check(copy.deepcopy(hosts), "hosts")
    assert list(check_document(copy.deepcopy(doc))) == list(doc)
    broken = copy.deepcopy(hosts)
    broken[1]["status"] = "fine"
    with pytest.raises(SchemaError, match=r"^\$\.hosts\[1\]\.status: "):
        check_document({**doc, "hosts": broken})
    with pytest.raises(SchemaError, match=r"^update\.hosts\[1\]\.status: "):
        check_update({"time": T, "hosts": broken, "removed": [], "set": {}})
    with pytest.raises(SchemaError, match="missing 'hosts'"):
        check_document({"version": 5, "time": T})


@pytest.mark.parametrize("where,key,value", [("share", "share_mib", 0),
                                             ("share", "seconds_left", -1),
                                             ("share", "gpu", "0"),
                                             ("reservation", "share_mib", 0),
                                             ("reservation", "expires", T + "\n")])
def test_a_share_is_a_reservation_with_minima(where: str, key: str, value: Any) -> None:
    """The schema's share is ``allOf`` a reservation with its ``minimum``s (the compiled
    check skips both): refused here as by the schema."""
    g = _gpu(random.Random(5))
    if where == "share":
        g["shares"] = [{**_reservation(random.Random(6), share=True), key: value}]
    else:
        g["reservation"] = {**_reservation(random.Random(6)), key: value}
    hosts = [{"name": "h", "status": "ok", "error": None, "gpus": [g]}]
    assert _schema_takes(hosts) == (where == "reservation" and key == "expires")
    with pytest.raises(SchemaError, match=rf"\.{where if where == 'reservation' else 'shares'}"):
        check_hosts(hosts, "$.hosts")
