"""A hub's patches are applied in place to the reader's own host objects
(``hub_patch.apply_changes``): on random and hostile sequences that pass the checks (a
GPU changed twice in one patch, a host changed in several changes, a host both complete
and changed, strings that a check cleans, hosts removed, or sent twice), the reader's
document is what a snapshot of the same document gives, no object in it is reachable
twice, each model the reader hands on is the one built from that snapshot, and a patch
that fails leaves the document as it was. The reference is a plain one: the same
changes merged into a copy of the document, checked and cleaned as a snapshot is."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest

from gputop.hubclient.client import Document, check_document, check_patch, host_from_dict
from gputop.hubclient.schema import SchemaError
from gputop.output import dumps
from tests.support.web_hub import fleet_doc

_GPU_VALUES: dict[str, list[Any]] = {
    "utilization_percent": [None, 0, 55, 100],
    "memory_used_mib": [None, 0, 1234],
    "power_draw_w": [None, 1.5, 301.25],
    "temperature_c": [40, 81],
    "name": ["NVIDIA H100", "\x1b[31mH100\u202e", "A100\nfake row"],
    "lost": [True, False],
    "lost_reason": [None, "GPU is lost\x07"],
    "index": [0, 3, 9],
    "uuid": ["GPU-a", "GPU-b", None],
    "processes": [[], [{"pid": 5, "user": "eve\x1b[2J", "command": "x\ny",
                        "gpu_memory_mib": 3}]],
    "flags": [[], ["lost"]],
    "reservation": [None],
    "unshared_mib": [None, 5],
}
_HOST_VALUES: dict[str, list[Any]] = {
    "time": ["2026-12-01T10:00:07Z", "2026-12-01T10:59:00Z"],
    "warnings": [[], ["\x1b[2Jwarn"], ["plain"]],
    "tags": [[], ["t\x07ag"]],
    "error": [None, None, {"kind": "timeout", "message": "no answer\x1b"}],
    "first_sample_s": [None, 1.5],
}


def _objects(value: Any, seen: dict[int, str], at: str) -> None:
    """Every dict and list under ``value``, each once (an object reachable twice is a
    change to one place that shows in another)."""
    if isinstance(value, (dict, list)):
        assert id(value) not in seen, f"{at} is {seen[id(value)]}"
        seen[id(value)] = at
        for k, v in (value.items() if isinstance(value, dict) else enumerate(value)):
            _objects(v, seen, f"{at}.{k}")


def _event(rnd: random.Random, hosts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    names = sorted(hosts)
    changes = []
    for _ in range(rnd.randint(0, 6)):
        name = rnd.choice(names) if rnd.random() < 0.97 else "ghost"
        n = len(hosts.get(name, {"gpus": []})["gpus"])
        gpus = []
        for _ in range(rnd.randint(0, 4)):
            if n == 0 and rnd.random() > 0.03:
                continue
            pos = rnd.randrange(n + 1) if rnd.random() < 0.03 else rnd.randrange(max(n, 1))
            keys = rnd.sample(sorted(_GPU_VALUES), rnd.randint(0, 3))
            gpus.append([pos, {k: rnd.choice(_GPU_VALUES[k]) for k in keys}])
        keys = rnd.sample(sorted(_HOST_VALUES), rnd.randint(0, 2))
        changes.append({"name": name, "set": {k: rnd.choice(_HOST_VALUES[k]) for k in keys},
                        "gpus": gpus})
    whole = []
    for _ in range(rnd.choice([0, 0, 0, 1, 2])):  # (twice the same host, now and then)
        h = copy.deepcopy(hosts[rnd.choice(names)])
        if h["gpus"] and rnd.random() < 0.5:
            h["gpus"].pop()
        whole.append(h)
    removed = [rnd.choice(names)] if rnd.random() < 0.1 else []
    return {"time": "2026-12-01T10:00:09Z", "hosts": whole, "changes": changes,
            "removed": removed, "set": {}}


def _reference(doc: dict[str, Any], event: dict[str, Any]) -> dict[str, Any] | None:
    """The document after ``event``, merged plainly into a copy and checked as a
    snapshot; None where the event is broken (a host or GPU position it does not have)."""
    doc = {**copy.deepcopy(doc), "time": event["time"]}
    hosts = {h["name"]: h for h in doc["hosts"]}
    order = [h["name"] for h in doc["hosts"]]
    for h in copy.deepcopy(event["hosts"]):
        if h["name"] not in hosts:
            order.append(h["name"])
        hosts[h["name"]] = h
    for name in event["removed"]:
        if hosts.pop(name, None) is not None:
            order.remove(name)
    for c in copy.deepcopy(event["changes"]):
        h = hosts.get(c["name"])
        if h is None or any(pos >= len(h["gpus"]) for pos, _ in c["gpus"]):
            return None
        h.update(c["set"])
        for pos, fields in c["gpus"]:
            h["gpus"][pos].update(fields)
    return check_document(json.loads(dumps({**doc, "hosts": [hosts[n] for n in order]})))


@pytest.mark.parametrize("seed", range(8))
def test_patches_applied_in_place_leave_what_a_snapshot_gives(seed: int) -> None:
    rnd = random.Random(seed)
    start = check_document(json.loads(dumps(fleet_doc(5, 3, seed=seed, failing=1))))
    reader = Document(copy.deepcopy(start))
    for h in reader.doc["hosts"]:
        reader.model(h)
    applied = refused = 0
    for _ in range(40):
        event = _event(rnd, reader.hosts)
        before = copy.deepcopy(reader.doc)
        want = _reference(before, event)
        try:
            touched = reader.apply_patch(*check_patch(json.loads(json.dumps(event))))
        except SchemaError:
            assert want is None, event
            assert reader.doc == before  # whole or not at all
            refused += 1
            reader = Document(copy.deepcopy(before))  # (the reader starts again)
            for h in reader.doc["hosts"]:
                reader.model(h)
            continue
        applied += 1
        assert want is not None, event
        assert reader.doc == want
        assert reader.order == [h["name"] for h in want["hosts"]]
        _objects(reader.doc, {}, "$")
        fresh = {h["name"]: host_from_dict(h) for h in want["hosts"]}
        for h, positions in touched:
            assert h["name"] in fresh, f"a model for {h['name']}, not in the document"
            assert reader.model(h, positions) == fresh[h["name"]]
        assert reader.models.keys() <= fresh.keys()
        for name, model in reader.models.items():
            assert model == fresh[name]
    assert applied > 10 and refused > 3  # (both kinds were tried)


def test_a_host_both_sent_and_removed_in_one_event_is_not_handed_on() -> None:
    """A hub's update (or patch) that carries a host and removes it too, or carries one
    host twice: the reader hands on only the hosts its document then holds, each once,
    as the object it holds (a removed one shown again, or its model kept, would be a host
    that no snapshot of the document has)."""
    start = check_document(json.loads(dumps(fleet_doc(3, 2, seed=4))))
    reader = Document(copy.deepcopy(start))
    a, b = copy.deepcopy(start["hosts"][0]), copy.deepcopy(start["hosts"][1])
    b2 = copy.deepcopy(b)
    b2["warnings"] = ["second"]
    event = {"time": "2026-12-01T10:00:09Z", "hosts": [a, b, b2], "changes": [],
             "removed": [a["name"]], "set": {}}
    touched = reader.apply_patch(*check_patch(json.loads(json.dumps(event))))
    assert a["name"] not in reader.hosts
    assert [h["name"] for h, _ in touched] == [b["name"]]
    assert all(reader.hosts[h["name"]] is h for h, _ in touched)
    for h, positions in touched:
        reader.model(h, positions)
    assert a["name"] not in reader.models
    assert reader.models[b["name"]].warnings == ("second",)
