"""Patch events (``/api/v1/events?patches=1``): the hub's ``host_change`` and the reader's
``check_patch``/``Document.apply_patch`` rebuild exactly the document that updates carry,
whatever the fleet does (numbers move, processes come and go, GPUs are added, lost,
renumbered or swapped, hosts fail and come back, keys appear); and a hostile patch is
refused whole, never applied in part."""

from __future__ import annotations

import contextlib
import copy
import json
import random
from typing import Any

import pytest

from gputop.hub.patches import host_change
from gputop.hubclient.client import Document, check_document, check_patch, host_from_dict
from gputop.hubclient.schema import SchemaError
from gputop.output import dumps
from tests.support.web_hub import fleet_doc


def _event(old: dict[str, dict[str, Any]], new: list[dict[str, Any]]) -> str:
    """A patch event for the hosts in ``new`` as the collector makes it."""
    whole, changes = [], []
    for h in new:
        c = host_change(old.get(h["name"]), h)
        if c is None:
            whole.append(h)
        else:
            changes.append(c)
    return dumps({"time": "2026-12-01T10:00:00Z", "hosts": whole, "changes": changes,
                  "removed": [], "set": {}})


def _mutate(h: dict[str, Any], rnd: random.Random) -> dict[str, Any]:
    h = copy.deepcopy(h)
    what = rnd.choice(["numbers", "numbers", "numbers", "process", "lost", "swap", "add",
                       "drop", "error", "recover", "key", "name"])
    gpus = h["gpus"]
    if what == "numbers" or (not gpus and what not in ("error", "recover")):
        for g in gpus:
            if rnd.random() < 0.6:
                g["utilization_percent"] = rnd.randint(0, 100)
                g["power_draw_w"] = round(rnd.uniform(50, 700), 2)
        h["time"] = h["last_ok"] = f"2026-12-01T10:{rnd.randint(0, 59):02d}:00Z"
    elif what == "process":
        g = rnd.choice(gpus)
        g["processes"] = [{"pid": rnd.randint(2, 99999), "user": "\x1b[31mmallory",
                           "command": "python -c 'x'\nfake row", "gpu_memory_mib": 5}]
    elif what == "lost":
        g = rnd.choice(gpus)
        g["lost"], g["lost_reason"] = True, "GPU is lost"
    elif what == "swap" and len(gpus) > 1:
        gpus[0], gpus[1] = gpus[1], gpus[0]
    elif what == "add":
        g = copy.deepcopy(gpus[-1])
        g["index"], g["uuid"] = len(gpus), f"GPU-new-{rnd.random()}"
        gpus.append(g)
    elif what == "drop":
        gpus.pop()
    elif what == "error":
        h.update(status="error", error={"kind": "timeout", "message": "no answer"}, gpus=[])
    elif what == "recover" and h["error"] is not None:
        h.update(status="ok", error=None)
    elif what == "key":  # a key set, emptied, gone or back
        if rnd.random() < 0.3:
            h.pop("first_sample_s", None)
        else:
            h["first_sample_s"] = rnd.choice([None, 1.5])
    elif what == "name" and gpus:
        rnd.choice(gpus)["name"] = "NVIDIA \u202eH100\x07"
    return h


@pytest.mark.parametrize("seed", range(6))
def test_patches_rebuild_what_updates_carry(seed: int) -> None:
    rnd = random.Random(seed)
    hub = check_document(json.loads(dumps(fleet_doc(12, 4, seed=seed, failing=2))))
    hosts = {h["name"]: h for h in hub["hosts"]}
    reader = Document(check_document(json.loads(dumps(hub))))
    for h in reader.doc["hosts"]:
        reader.model(h)
    for _ in range(40):
        changed = [_mutate(hosts[n], rnd) for n in rnd.sample(sorted(hosts), rnd.randint(1, 5))]
        event = _event(hosts, changed)
        for h in changed:
            hosts[h["name"]] = h
        touched = reader.apply_patch(*check_patch(json.loads(event)))
        # Exactly what a complete update would have left, cleaned the same way.
        want = check_document(json.loads(dumps({**hub, "hosts": list(hosts.values())})))
        assert reader.doc["hosts"] == want["hosts"]
        assert sorted(h["name"] for h, _ in touched) == sorted({h["name"] for h in changed})
        for h, positions in touched:
            # The model with the unchanged GPUs reused is the model built from scratch.
            assert reader.model(h, positions) == host_from_dict(h)


def test_a_host_of_the_same_shape_comes_as_its_changed_keys() -> None:
    doc = fleet_doc(2, 4, seed=3)
    old = doc["hosts"][0]
    new = copy.deepcopy(old)
    new["time"] = "2026-12-01T10:00:02Z"
    new["gpus"][2]["utilization_percent"] = 77
    change = host_change(old, new)
    assert change == {"name": old["name"], "set": {"time": "2026-12-01T10:00:02Z"},
                      "gpus": [[2, {"utilization_percent": 77}]]}
    swapped = copy.deepcopy(old)
    swapped["gpus"].reverse()
    assert host_change(old, swapped) is None  # other GPUs in those places: complete
    assert host_change(None, new) is None


def _reader() -> tuple[Document, dict[str, Any]]:
    doc = check_document(json.loads(dumps(fleet_doc(2, 2, seed=5))))
    return Document(copy.deepcopy(doc)), doc


def _patch(changes: Any) -> Any:
    return {"time": "2026-12-01T10:00:00Z", "hosts": [], "changes": changes, "removed": [],
            "set": {}}


@pytest.mark.parametrize("change", [
    {"name": "nobody", "set": {}, "gpus": []},  # a host the reader does not have
    {"name": "HOST", "set": {}, "gpus": [[7, {"utilization_percent": 1}]]},  # no such GPU
    {"name": "HOST", "set": {"gpus": []}, "gpus": []},  # gpus only by position
    {"name": "HOST", "set": {"name": "other"}, "gpus": []},  # a host's name never moves
    {"name": "HOST", "set": {"colour": 1}, "gpus": []},  # unknown host key
    {"name": "HOST", "set": {}, "gpus": [[0, {"shell": "rm -rf /"}]]},  # unknown GPU key
    {"name": "HOST", "set": {}, "gpus": [[0, {"utilization_percent": "50"}]]},
    {"name": "HOST", "set": {}, "gpus": [[0, {"lost": 1}]]},  # 1 is not true
    {"name": "HOST", "set": {}, "gpus": [[0, {"memory_used_mib": 2 ** 70}]]},
    {"name": "HOST", "set": {}, "gpus": [[-1, {}]]},
    {"name": "HOST", "set": {}, "gpus": [[True, {}]]},
    {"name": "HOST", "set": {}, "gpus": [[0, {}, 1]]},
    {"name": "HOST", "set": {}, "gpus": [[0, {"processes": [{"pid": 1}]}]]},
    {"name": "HOST", "set": {"time": "yesterday"}, "gpus": []},
    {"name": "HOST", "set": {}},  # keys missing
    {"name": "HOST", "set": {}, "gpus": [], "extra": 1},
    {"name": 5, "set": {}, "gpus": []},
])
def test_a_hostile_patch_is_refused_whole(change: dict[str, Any]) -> None:
    reader, doc = _reader()
    name = doc["hosts"][0]["name"]
    if change.get("name") == "HOST":
        change = {**change, "name": name}
    good = {"name": name, "set": {}, "gpus": [[0, {"utilization_percent": 1}]]}
    before = copy.deepcopy(reader.doc)
    with pytest.raises(SchemaError):
        reader.apply_patch(*check_patch(json.loads(json.dumps(_patch([good, change])))))
    assert reader.doc == before  # nothing was applied, not even the good change


def test_strings_in_a_patch_are_cleaned_as_in_a_complete_host() -> None:
    reader, doc = _reader()
    name = doc["hosts"][0]["name"]
    hostile = {"name": "\x1b]0;owned\x07NVIDIA\u202e",
               "processes": [{"pid": 9, "user": "eve\x1b[2J", "command": "a\nb",
                              "gpu_memory_mib": 1}]}
    update, changes = check_patch(json.loads(json.dumps(_patch(
        [{"name": name, "set": {"warnings": ["\x1b[31mred"]}, "gpus": [[1, hostile]]}]))))
    reader.apply_patch(update, changes)
    h = reader.hosts[name]
    complete = check_document(json.loads(json.dumps({**doc, "hosts": [
        {**doc["hosts"][0], "warnings": ["\x1b[31mred"],
         "gpus": [doc["hosts"][0]["gpus"][0], {**doc["hosts"][0]["gpus"][1], **hostile}]},
        doc["hosts"][1]]})))
    assert h == complete["hosts"][0]
    assert "\x1b" not in json.dumps(h, ensure_ascii=False)
    assert reader.hosts[doc["hosts"][1]["name"]] == doc["hosts"][1]  # the other untouched


def test_each_subscriber_gets_its_kind_and_a_resume_gets_the_same() -> None:
    from gputop.hub.events import EventLog

    log = EventLog(epoch="e")
    plain = log.subscribe(lambda: None)
    patched = log.subscribe(lambda: None, patches=True)
    assert plain is not None and patched is not None
    log.publish('{"u": 1}', '{"p": 1}')
    log.publish('{"u": 2}')  # (no patch form: the update goes to everyone)
    assert [f.split(b"\n")[0] for f in plain.take()] == [b"event: update"] * 2
    assert [f.split(b"\n")[0] for f in patched.take()] == [b"event: patch", b"event: update"]
    assert [f.split(b"\n")[1] for f in log.missed("e-0", patches=True) or []] == [
        b"id: e-1", b"id: e-2"]
    assert (log.missed("e-0", patches=True) or [])[0].endswith(b'data: {"p": 1}\n\n')
    assert (log.missed("e-0") or [])[0].endswith(b'data: {"u": 1}\n\n')


def _recording_hub(answer: Any, asked: list[bytes]) -> Any:
    """A fake hub (``test_hostile_hub_client.FakeHub``) that keeps each request it is sent
    in ``asked`` before ``answer`` answers it."""
    from tests.test_hostile_hub_client import FakeHub

    hub = FakeHub(answer)

    def one(c: Any) -> None:  # the request, then the answer
        c.settimeout(5)
        asked.append(c.recv(65536))
        try:
            hub.answer(c)
        finally:
            c.close()

    hub._one = one  # type: ignore[method-assign]
    return hub


async def test_a_broken_patch_makes_the_reader_start_again_from_a_snapshot() -> None:
    """A patch for a host the reader does not have: its copy no longer matches the hub's,
    so it asks for a fresh snapshot (no ``Last-Event-ID``) instead of the same patch."""
    import asyncio
    import socket

    from gputop.config.load import Config
    from gputop.config.tables import Defaults, Hub
    from gputop.hubclient.poller import HubPoller

    doc = fleet_doc(1, 1, seed=2)
    bad = json.dumps(_patch([{"name": "ghost", "set": {}, "gpus": []}]))
    asked: list[bytes] = []

    def answer(c: socket.socket) -> None:
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
                  + f"event: snapshot\nid: e-1\ndata: {json.dumps(doc)}\n\n".encode()
                  + f"event: patch\nid: e-2\ndata: {bad}\n\n".encode())

    hub = _recording_hub(answer, asked)
    poller = HubPoller(Config(path=None, hosts=(), hub=Hub(url=hub.url),
                              defaults=Defaults(timeout=5.0)))
    errors = 0
    try:
        async def read() -> None:
            nonlocal errors
            async for h in poller.updates():
                if h.error is not None and h.error.kind == "parse":
                    errors += 1
                    if errors == 2:
                        return
        await asyncio.wait_for(read(), 30)
    finally:
        await poller.aclose()
        hub.close()
    assert len(asked) >= 2
    assert all(b"last-event-id" not in r.lower() for r in asked), asked


async def test_the_hub_works_out_patches_only_while_someone_reads_them(tmp_path: Any) -> None:
    """A real hub's collector folds an answer as an update alone while only update
    readers listen, and as both once a patch reader is there."""
    from gputop.config.load import load_config
    from gputop.hub.server import Hub
    from gputop.model import GpuInfo, HostSnapshot
    from tests.test_hub_parts import local_config

    hub = Hub(load_config(str(local_config(tmp_path))))
    seen: list[str | None] = []
    publish = hub._published

    def published(update: str, patch: str | None) -> None:
        seen.append(patch)
        publish(update, patch)

    hub.collector.on_update = published

    def answer(util: int) -> None:
        hub.collector.observe(HostSnapshot("here", source="nvml", gpus=(
            GpuInfo(index=0, uuid="GPU-1", name="T", utilization_percent=util),)))
        hub.collector.fold()

    answer(1)
    plain = hub.events.subscribe(lambda: None)
    answer(2)
    assert seen[-1] is None  # nobody reads patches: none worked out
    patched = hub.events.subscribe(lambda: None, patches=True)
    answer(3)
    assert seen[-1] is not None and json.loads(seen[-1])["changes"][0]["gpus"] == [
        [0, {"utilization_percent": 3}]]
    assert plain is not None and patched is not None
    assert [f.split(b"\n")[0] for f in patched.take()] == [b"event: patch"]
    assert [f.split(b"\n")[0] for f in plain.take()] == [b"event: update"] * 2


async def test_a_host_the_hub_removed_does_not_come_back_when_the_reader_resumes() -> None:
    """After a drop the reader resumes with ``Last-Event-ID`` and hands on the last
    answers it kept first (the hosts shown as "hub down" meanwhile get their data back):
    a host an update had removed came back with them, on every reconnect."""
    import asyncio
    import socket

    from gputop.config.load import Config
    from gputop.config.tables import Defaults, Hub
    from gputop.hubclient.poller import HubPoller

    doc = fleet_doc(2, 1, seed=3)
    gone = doc["hosts"][1]["name"]
    removal = json.dumps({"time": doc["time"], "hosts": [], "removed": [gone], "set": {}})
    quiet = json.dumps({"time": doc["time"], "hosts": [], "removed": [], "set": {}})
    asked: list[bytes] = []

    def answer(c: socket.socket) -> None:
        if len(asked) == 1:  # the first connection: the snapshot, then the removal
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
                      + f"event: snapshot\nid: e-1\ndata: {json.dumps(doc)}\n\n".encode()
                      + f"event: update\nid: e-2\ndata: {removal}\n\n".encode())
        else:  # resumed: one more (empty) update, then the stream stays open a moment
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
                      + f"event: update\nid: e-3\ndata: {quiet}\n\n".encode())
            c.settimeout(1)
            with contextlib.suppress(OSError):
                c.recv(1)

    hub = _recording_hub(answer, asked)
    poller = HubPoller(Config(path=None, hosts=(), hub=Hub(url=hub.url),
                              defaults=Defaults(timeout=5.0)))
    after_resume: list[str] = []
    try:
        async def read() -> None:
            async for h in poller.updates():
                if len(asked) >= 2 and h.error is None:
                    after_resume.append(h.name)

        reading = asyncio.ensure_future(read())
        for _ in range(300):
            if after_resume:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # (what else the resume hands on)
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading
    finally:
        await poller.aclose()
        hub.close()
    assert b"last-event-id: e-2" in asked[1].lower()
    assert after_resume == [doc["hosts"][0]["name"]], after_resume
