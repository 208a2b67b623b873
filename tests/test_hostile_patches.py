"""What landed with hub patches, the woken drain and kept board rows, attacked: a hostile
hub's patch that names one host again and again, a hub that keeps adding and removing
hosts, a key held while answers wait, a share or reservation whose time left must count
down on a row the board kept, and the hub's retained window when a patch is the update.

Each test here failed before its fix, for the reason its docstring gives."""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from gputop.hubclient.client import Document, check_document, check_patch, check_update
from gputop.model import HostSnapshot, utcnow
from gputop.output import dumps
from gputop.reservations.state import StoreState
from gputop.reservations.terms import Target, Terms, new_reservation
from gputop.ui.board_model import BoardModel
from gputop.ui.board_rows import GpuRow
from gputop.ui.cells import Palette, row_cells
from tests.support.board_data import NOW, board_config, fixed_snapshots
from tests.support.web_hub import fleet_doc

# --- a hostile hub's patches ------------------------------------------------------------------


_BASE = fleet_doc(1, 1, seed=4)


def _one_host_of(gpus: int) -> Document:
    doc = copy.deepcopy(_BASE)
    g = doc["hosts"][0]["gpus"][0]
    doc["hosts"][0]["gpus"] = [{**copy.deepcopy(g), "index": i, "uuid": f"GPU-{i}"}
                               for i in range(gpus)]
    return Document(check_document(json.loads(dumps(doc))))


def _patch(changes: list[dict[str, Any]]) -> Any:
    return json.loads(json.dumps({"time": "2026-12-01T10:00:00Z", "hosts": [],
                                  "changes": changes, "removed": [], "set": {}}))


def test_a_patch_naming_one_host_again_and_again_costs_its_length(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A patch may list up to 100,000 changes, and nothing stops a hostile hub from naming
    the same host in each: applying one copied that host's whole GPU list, and every
    position changed so far, once per change (a few MB of patch: minutes of the feed
    thread; 50,000 changes for a host of 10,000 GPUs, a 3.9 MB patch, took 2.9 s against
    0.12 s now). Counted, not timed: the same positions as one change and as one change
    each copy nothing (a patch is applied in place: the reader's host objects are its
    own) but the list of what it touched."""
    from gputop.hubclient import patch as hub_patch

    n = 2000
    name = _one_host_of(n).order[0]
    one = _patch([{"name": name, "set": {},
                   "gpus": [[i, {"utilization_percent": i % 100}] for i in range(n)]}])
    each = _patch([{"name": name, "set": {}, "gpus": [[i, {"utilization_percent": i % 100}]]}
                   for i in range(n)])
    copies: dict[str, int] = {}

    def counted(kind: type) -> Any:
        def make(*args: Any) -> Any:
            copies[kind.__name__] = copies.get(kind.__name__, 0) + 1
            return kind(*args)
        return make

    docs = []
    for patch in (one, each):
        reader = _one_host_of(n)
        checked = check_patch(patch)
        copies.clear()
        monkeypatch.setattr(hub_patch, "dict", counted(dict), raising=False)
        monkeypatch.setattr(hub_patch, "list", counted(list), raising=False)
        reader.apply_patch(*checked)
        monkeypatch.undo()
        assert copies == {"list": 1}, copies  # (the list it returns)
        docs.append(reader.doc)
    assert docs[0] == docs[1]  # (the same change, whichever way it came)


def test_a_patch_naming_a_gpu_again_gives_its_last_values_and_all_its_keys() -> None:
    reader = _one_host_of(2)
    name = reader.order[0]
    touched = reader.apply_patch(*check_patch(_patch([
        {"name": name, "set": {}, "gpus": [[1, {"utilization_percent": 5}]]},
        {"name": name, "set": {"time": "2026-12-01T10:00:01Z"},
         "gpus": [[1, {"utilization_percent": 6, "temperature_c": 40}], [0, {}]]}])))
    (h, keys), = touched
    assert h is reader.hosts[name]
    assert h["time"] == "2026-12-01T10:00:01Z"
    assert keys == {1: {"utilization_percent": 6, "temperature_c": 40}, 0: {}}
    assert h["gpus"][1]["utilization_percent"] == 6 and h["gpus"][1]["temperature_c"] == 40


def test_a_hub_that_adds_and_removes_hosts_leaves_no_model_behind() -> None:
    """The reader keeps each host's model for the next patch; a host the hub removed
    kept its model for ever: a hostile hub adding a thousand new names and removing them
    again, event after event, grew the board's memory without bound."""
    reader = Document(check_document(json.loads(dumps(fleet_doc(2, 1, seed=6)))))
    for h in reader.doc["hosts"]:
        reader.model(h)
    template = reader.doc["hosts"][0]
    for i in range(30):
        names = [f"churn-{i}-{k}" for k in range(20)]
        added = check_update(json.loads(dumps({
            "time": "2026-12-01T10:00:00Z", "removed": [], "set": {},
            "hosts": [{**template, "name": n} for n in names]})))
        for h in reader.apply(added):
            reader.model(h)
        gone = check_update(json.loads(dumps({"time": "2026-12-01T10:00:01Z", "hosts": [],
                                              "removed": names, "set": {}})))
        reader.apply(gone)
    assert reader.order == [h["name"] for h in reader.doc["hosts"]] == list(reader.hosts)
    assert len(reader.order) == 2
    assert set(reader.models) <= set(reader.hosts), len(reader.models)


# --- the hub's retained window ------------------------------------------------------------------


def test_an_event_whose_hosts_all_go_complete_is_kept_once(tmp_path: Path) -> None:
    """Each retained event is kept as an update and as a patch; when every changed host
    goes complete (the first answers, hosts failing) the patch was the update again with
    ``"changes": []``: the window (256 events, each about 1 MB at 200 x 8) held it
    twice. Now there is no patch form then: patch readers get the update (they take
    both)."""
    from gputop.config.load import load_config
    from gputop.hub.collector import Collector
    from gputop.hub.events import EventLog

    cfg = tmp_path / "hosts.toml"
    cfg.write_text(f'[reservations]\npath = "{tmp_path / "r.json"}"\n'
                   '[[hosts]]\nname = "here"\nlocal = true\n')
    c = Collector(load_config(str(cfg)))
    log = EventLog(epoch="e")
    c.on_update = log.publish
    c.refresh_store()
    gpus = fixed_snapshots()[0].gpus
    c.observe(HostSnapshot(name="here", time=utcnow(), gpus=gpus))
    c.fold()  # from its placeholder ("starting") to its GPUs: complete
    assert len(log.retained) == 1
    _, update, patch = log.retained[-1]
    assert patch is update  # one object: kept once
    data = json.loads(update.split(b"data: ", 1)[1])
    assert set(data) == {"time", "hosts", "removed", "set"} and data["hosts"]
    moved = replace(gpus[0], utilization_percent=(gpus[0].utilization_percent or 0) + 1)
    c.observe(HostSnapshot(name="here", time=utcnow(), gpus=(moved, *gpus[1:])))
    c.fold()  # the same shape, one GPU moved: a patch of its own
    _, update, patch = log.retained[-1]
    assert patch.startswith(b"event: patch\n")
    data = json.loads(patch.split(b"data: ", 1)[1])
    assert data["hosts"] == [] and data["changes"][0]["gpus"][0][0] == 0


# --- the board: a key held while answers wait ---------------------------------------------------


async def test_a_held_key_puts_the_drain_off_until_after_it_without_spinning(
        tmp_path: Path) -> None:
    """While a key is handled the drain waits (KEY_HOLD_S), but never more than
    KEY_DRAIN_MAX_S after the last drain. Its next try was asked of ``_drain_soon`` as a
    delay from now, which counts delays from the last drain: from KEY_HOLD_S after the
    last drain on, every try was due at once, and the board's loop spun (tens of
    thousands of tries a second) for the rest of each held key."""
    from gputop.ui.app import GputopApp
    from gputop.ui.intake import KEY_DRAIN_MAX_S, KEY_HOLD_S

    app = GputopApp(board_config(tmp_path), feed=False, clock=lambda: NOW, user="ann")
    async with app.run_test(size=(120, 40)):
        loop = asyncio.get_running_loop()
        if app.intake._drain_timer is not None:
            app.intake._drain_timer.cancel()
            app.intake._drain_timer = None
        app.intake._inbox.put(fixed_snapshots()[0])
        since = 0.2  # the last drain this long ago (past KEY_HOLD_S: where it spun)
        app.intake._last_drain = time.perf_counter() - since
        app.intake._key_hold_until = time.monotonic() + KEY_HOLD_S  # a key just came
        app.intake.drain()
        assert app.intake._inbox.qsize() == 1  # held: not taken during the key
        timer = app.intake._drain_timer
        assert timer is not None
        wait = timer.when() - loop.time()
        # After the key, or KEY_DRAIN_MAX_S after the last drain: here about 0.1 s.
        assert 0.5 * (KEY_DRAIN_MAX_S - since) < wait <= KEY_DRAIN_MAX_S - since, wait
        for _ in range(200):  # then it does drain (not put off for good)
            if app.intake._inbox.empty():
                break
            await asyncio.sleep(0.025)
        assert app.intake._inbox.empty()


# --- the board: rows kept, times left counting down ---------------------------------------------


def _cells(model: BoardModel) -> dict[str, tuple[tuple[object, ...], list[str]]]:
    now = model.clock()
    return {r.key: (model.signature(r, now), [c.plain for c in row_cells(r, now, Palette())])
            for r in model.rows() if isinstance(r, GpuRow)}


def test_equal_signatures_mean_equal_cells_as_time_left_runs_down() -> None:
    """The table rebuilds a row's cells only when its signature changes. A row's
    signature became the row itself (kept, or equal, while its GPU does not change: a hub
    patch leaves unchanged GPUs as they were): a share row, equal each answer, kept
    showing the time left it had when first drawn, however long it stood (and a
    reservation's showed it up to a minute late, its minute not being the display's)."""
    host = fixed_snapshots()[0]
    clock = [NOW]
    model = BoardModel(host_order=[host.name], clock=lambda: clock[0], me="ann")
    model.set_state(StoreState(reservations=(
        new_reservation(
            Target(host.name, 0), Terms(3600, user="alice", machine="m", share_mib=30 * 1024), NOW),
        new_reservation(Target(host.name, 1), Terms(10 * 60 + 40, user="bob", machine="m"), NOW))))
    model.ingest(host)
    seen = [_cells(model)]
    for later in (timedelta(seconds=50), timedelta(minutes=10)):
        clock[0] = NOW + later
        # The host answers again, its GPUs' objects the same (a patch that moved nothing).
        model.ingest(HostSnapshot(name=host.name, time=clock[0], gpus=host.gpus,
                                  last_ok=clock[0], tags=host.tags))
        seen.append(_cells(model))
    shown = set()
    for before, after in itertools.pairwise(seen):
        for key, (sig, cells) in after.items():
            if key in before:
                shown.add(tuple(cells))
                if before[key][0] == sig:
                    assert before[key][1] == cells, key
    # (the times did move: the share's 1h00m -> 50m, bob's 11m -> 10m -> 0m)
    assert any("50m" in " ".join(c) for c in shown)


def test_a_gpu_patchs_numbers_checked_inline_pass_and_fail_as_their_own_checks_do() -> None:
    """``hub_patch._gpu_fields`` checks a GPU patch's plain numbers inline: for every mix
    of keys (the inline ones and others) and hostile values (a bool, a float where an
    integer goes, NaN, infinity, a huge integer, a string, a dict) it keeps, cleans or
    refuses exactly what each key's own check does."""
    from gputop.hubclient.hosts import GPU_FIELDS
    from gputop.hubclient.patch import _fields, _gpu_fields
    from gputop.hubclient.schema import MAX_INT, SchemaError

    values: list[Any] = [None, 0, 7, -3, 2.5, True, False, float("nan"), float("inf"),
                         MAX_INT, -MAX_INT, MAX_INT - 1, "12", "\x1b[31mx", {}, []]
    keys = ["utilization_percent", "memory_used_mib", "power_draw_w", "temperature_c",
            "name", "lost", "nope"]

    def outcome(check: Any, d: dict[str, Any]) -> object:
        try:
            out = check(d)
        except SchemaError as exc:
            return ("refused", str(exc))
        return ("kept" if out is d else "cleaned", json.dumps(out, sort_keys=True))

    seen = 0
    for k1, k2 in itertools.product(keys, repeat=2):
        for v1, v2 in itertools.product(values, repeat=2):
            d = {k1: v1, k2: v2}
            assert outcome(_gpu_fields, d) == outcome(
                lambda x: _fields(x, GPU_FIELDS), d), d
            seen += 1
    assert seen == 49 * 256
    assert outcome(_gpu_fields, {"utilization_percent": True})[0] == "refused"
    assert outcome(_gpu_fields, {"power_draw_w": float("nan")})[0] == "refused"
    assert outcome(_gpu_fields, [])[0] == "refused"
