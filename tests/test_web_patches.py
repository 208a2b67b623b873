"""The web page reads the hub's ``patch`` events (docs/hub.md) in a real headless
Chromium: a host whose GPUs moved comes as what moved, a GPU that did not move keeps its
object and its row is not written, and a patch that does not fit what the page holds (a
host it does not know, a GPU position the host does not have, a key a change may not
carry, a wrong type) is applied not at all: the page starts again from a snapshot."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.web_hub import DocHub, fleet_doc
from tests.test_web_board import live_board, wait


@pytest.fixture(scope="module")
def paged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DocHub, Any, dict[str, Any]]]:
    yield from live_board(fleet_doc(6, 4, seed=11), tmp_path_factory.mktemp("patchhub"))


def _cell(b: Any, host: str, index: int, cls: str) -> str:
    return str(b.execute_script(
        "const s = document.querySelector(`section.host[data-host='${arguments[0]}']`);"
        "const g = [...s.querySelectorAll('.gpu')].find("
        "  (r) => r.querySelector('.idx').textContent === String(arguments[1]));"
        "return g.querySelector(arguments[2]).textContent;", host, index, cls))


def _misfit(h: DocHub, doc: dict[str, Any]) -> None:
    """A patch of a host the page does not know: it fits nothing (a resync follows)."""
    h.publish_raw(json.dumps({"time": doc["time"], "hosts": [], "removed": [], "set": {}}),
                  json.dumps({"time": doc["time"], "hosts": [], "removed": [], "set": {},
                              "changes": [{"name": "nobody", "set": {}, "gpus": []}]}))


def _snapshots_through(b: Any, handle: str) -> None:
    """From now on every stream's ``snapshot`` events reach the page through ``handle``, a
    JS function of (event, listener); ``_real_snapshots`` undoes it."""
    b.execute_script("""const add = EventSource.prototype.addEventListener;
        window.realAdd = add;
        const handle = (""" + handle + """);
        EventSource.prototype.addEventListener = function (type, fn, ...rest) {
          return add.call(this, type, type === "snapshot" ? (e) => handle(e, fn) : fn,
                          ...rest);
        };""")


def _real_snapshots(b: Any) -> None:
    b.execute_script("EventSource.prototype.addEventListener = window.realAdd")


def _move(h: DocHub, doc: dict[str, Any], host: int, gpu: int, util: int) -> dict[str, Any]:
    """One GPU of one host moves; the host as the hub then sends it."""
    new = copy.deepcopy(doc["hosts"][host])
    new["gpus"][gpu]["utilization_percent"] = util
    doc["hosts"][host] = new
    h.publish([new])
    return new


def test_a_patch_moves_what_moved_and_writes_no_other_row(
        paged: tuple[DocHub, Any, dict[str, Any]]) -> None:
    h, b, doc = paged
    assert h.hub.events.patch_readers()  # (the page asked for patches)
    name = doc["hosts"][0]["name"]
    b.execute_script("""window.written = 0; new MutationObserver((m) => {
        window.written += m.length; }).observe(
        document.querySelector(`section.host[data-host='${arguments[0]}'] .gpu:nth-child(2)`),
        {subtree: true, characterData: true, childList: true, attributes: true});""", name)
    before = b.execute_script("return [window.gputopBoard.updates, window.gputopBoard.snapshots,"
                              " window.gputopBoard.resyncs]")
    _move(h, doc, 0, 0, 93)
    wait(b, "return window.gputopBoard.updates > arguments[0]", "patch", 10, before[0])
    assert _cell(b, name, 0, ".util .val") == "93%"
    # Taken as a patch (no snapshot again), and the GPU that did not move was not touched.
    assert b.execute_script("return [window.gputopBoard.snapshots, window.gputopBoard.resyncs]"
                            ) == before[1:]
    assert b.execute_script("return window.written") == 0
    # The page's copy of the host is the hub's document, key for key.
    held: dict[str, Any] = b.execute_script(
        "return window.gputopBoard.hosts.get(arguments[0])", name)
    assert held == json.loads(json.dumps(doc["hosts"][0]))


HOSTILE = [
    ("a host the page does not know", lambda n: [{"name": "nobody", "set": {}, "gpus": []}]),
    ("a position past the host's GPUs",
     lambda n: [{"name": n, "set": {}, "gpus": [[4, {"utilization_percent": 1}]]}]),
    ("a negative position", lambda n: [{"name": n, "set": {}, "gpus": [[-1, {}]]}]),
    ("a position as text", lambda n: [{"name": n, "set": {}, "gpus": [["0", {}]]}]),
    ("a position with a fraction", lambda n: [{"name": n, "set": {}, "gpus": [[0.5, {}]]}]),
    ("a host's GPUs set whole", lambda n: [{"name": n, "set": {"gpus": []}, "gpus": []}]),
    ("a host renamed", lambda n: [{"name": n, "set": {"name": "x"}, "gpus": []}]),
    ("fields that are not an object", lambda n: [{"name": n, "set": {}, "gpus": [[0, [1]]]}]),
    ("changes that are not a list", lambda n: {"name": n}),
    ("a change that is not an object", lambda n: [7]),
]


@pytest.mark.parametrize("what,changes", HOSTILE, ids=[w for w, _ in HOSTILE])
def test_a_patch_that_does_not_fit_is_not_applied_and_the_page_starts_again(
        paged: tuple[DocHub, Any, dict[str, Any]], what: str, changes: Any) -> None:
    h, b, doc = paged
    name = doc["hosts"][1]["name"]
    # A good change first in the same patch: applied not at all either.
    good = {"name": name, "set": {}, "gpus": [[1, {"utilization_percent": 61}]]}
    bad = changes(name)
    patch = {"time": doc["time"], "hosts": [], "removed": [], "set": {},
             "changes": [good, *bad] if isinstance(bad, list) else bad}
    was = _cell(b, name, 1, ".util .val")
    b.execute_script("window.gputopBoard.resyncRun = 0")  # (each case alone: no backoff)
    before = b.execute_script("return [window.gputopBoard.snapshots, window.gputopBoard.resyncs]")
    h.publish_raw(json.dumps({"time": doc["time"], "hosts": [], "removed": [], "set": {}}),
                  json.dumps(patch))
    wait(b, "return window.gputopBoard.resyncs > arguments[0]", f"a resync after {what}", 10,
         before[1])
    wait(b, "return window.gputopBoard.snapshots > arguments[0] && "
            "window.gputopBoard.conn === 'live'", "the snapshot again", 15, before[0])
    # The page shows the hub's document, none of the patch.
    assert _cell(b, name, 1, ".util .val") == was != "61%"
    assert b.execute_script("return document.querySelectorAll('.gpu').length") == 6 * 4
    assert [e for e in b.get_log("browser") if e["level"] == "SEVERE"] == []


def test_a_proto_key_in_a_patch_stays_data(paged: tuple[DocHub, Any, dict[str, Any]]) -> None:
    h, b, doc = paged
    name = doc["hosts"][2]["name"]
    before = b.execute_script("return [window.gputopBoard.updates, window.gputopBoard.resyncs]")
    patch = json.dumps({"time": doc["time"], "hosts": [], "removed": [], "set": {}, "changes": [
        {"name": name, "set": {"__proto__": {"polluted": 1}},
         "gpus": [[0, {"__proto__": {"polluted": 2}, "utilization_percent": 17}]]}]})
    assert '"__proto__"' in patch
    h.publish_raw(json.dumps({"time": doc["time"], "hosts": [], "removed": [], "set": {}}), patch)
    wait(b, "return window.gputopBoard.updates > arguments[0]", "patch", 10, before[0])
    assert _cell(b, name, 0, ".util .val") == "17%"
    got = b.execute_script("""const h = window.gputopBoard.hosts.get(arguments[0]);
        return [Object.getPrototypeOf(h) === Object.prototype, h.polluted ?? null,
                Object.getPrototypeOf(h.gpus[0]) === Object.prototype, h.gpus[0].polluted ?? null,
                ({}).polluted ?? null, window.gputopBoard.resyncs];""", name)
    assert got == [True, None, True, None, None, before[1]]


def test_patches_that_keep_not_fitting_start_the_stream_again_less_and_less_often(
        paged: tuple[DocHub, Any, dict[str, Any]]) -> None:
    """A hub whose every patch misfits (a broken one) costs it a snapshot per page at most
    every few seconds, not one per patch, and the page says meanwhile that what it shows is
    not current; then it starts again and is live."""
    h, b, doc = paged
    board = "window.gputopBoard"
    b.execute_script(f"{board}.resyncRun = 0")
    waits = []
    for _ in range(3):
        wait(b, f"return {board}.conn === 'live'", "live before the patch", 15)
        before = b.execute_script(f"return [{board}.snapshots, {board}.resyncs]")
        _misfit(h, doc)
        wait(b, f"return {board}.resyncs > arguments[0]", "a resync", 10, before[1])
        waits.append(b.execute_script(f"return {board}.resyncWait"))
        if waits[-1]:
            # Waiting: not connected, and not called current.
            assert b.execute_script(f"return [{board}.conn, document.title]") == [
                "stale", "gputop (stale)"]
            assert b.execute_script(f"return {board}.snapshots") == before[0]
        wait(b, f"return {board}.snapshots > arguments[0] && {board}.conn === 'live'",
             "the snapshot again", 15, before[0])
    assert waits == [0, 0, 2000]  # the first two at once, the third after 2 s
    assert b.execute_script("return document.querySelectorAll('.gpu').length") == 6 * 4
    assert [e for e in b.get_log("browser") if e["level"] == "SEVERE"] == []



def test_after_a_resync_the_page_is_live_only_once_the_new_snapshot_came(
        paged: tuple[DocHub, Any, dict[str, Any]]) -> None:
    """The new stream opens before its snapshot comes; a hub slow to send it must not have
    the page call the old data current meanwhile (the open stream alone is not enough)."""
    h, b, doc = paged
    board = "window.gputopBoard"
    wait(b, f"return {board}.conn === 'live'", "live before the patch", 15)
    # Snapshots reach the page 4 s late from now on (the stream itself opens at once).
    _snapshots_through(b, "(e, fn) => setTimeout(() => fn(e), 4000)")
    try:
        b.execute_script(f"{board}.resyncRun = 0")
        before = b.execute_script(f"return [{board}.snapshots, {board}.resyncs]")
        _misfit(h, doc)
        wait(b, f"return {board}.resyncs > arguments[0]", "a resync", 10, before[1])
        # A patch that fits what the page holds, on the new stream before its snapshot:
        # not taken (nothing is current until the snapshot), and not called current.
        wait(b, "return window.performance.now() > arguments[0]", "the new stream", 5,
             b.execute_script("return window.performance.now()") + 800)
        _move(h, doc, 3, 0, 77)
        # Past the open stream's 1.5 s moment, before the snapshot: still not current.
        wait(b, "return window.performance.now() > arguments[0]", "2.5 s", 5,
             b.execute_script("return window.performance.now()") + 1700)
        assert b.execute_script(f"return [{board}.conn, {board}.snapshots, document.title]") \
            == ["stale", before[0], "gputop (stale)"]
        wait(b, f"return {board}.snapshots > arguments[0] && {board}.conn === 'live'",
             "the snapshot, then live", 15, before[0])
    finally:
        _real_snapshots(b)


def test_a_hub_that_keeps_misfitting_stays_at_the_longest_wait(
        paged: tuple[DocHub, Any, dict[str, Any]]) -> None:
    """The run of misfits ends only after a quiet spell: one misfit a while after a run of
    them (the page waited and came back) still waits the longest; after two quiet minutes
    the next one starts again at once. (It leaves the page waiting: it reloads it after.)"""
    h, b, doc = paged
    board = "window.gputopBoard"
    waits = []
    for quiet_s in (130, 70):
        wait(b, f"return {board}.conn === 'live'", "live before the patch", 15)
        b.execute_script(f"{board}.resyncRun = 9; {board}.lastResync = Date.now() - arguments[0]",
                         quiet_s * 1000)
        before = b.execute_script(f"return {board}.resyncs")
        _misfit(h, doc)
        wait(b, f"return {board}.resyncs > arguments[0]", "a resync", 10, before)
        waits.append(b.execute_script(f"return {board}.resyncWait"))
    assert waits == [0, 30000]
    b.refresh()
    wait(b, f"return {board} && {board}.conn === 'live'", "a fresh page live", 20)


def test_a_snapshot_that_does_not_parse_starts_the_stream_again(
        paged: tuple[DocHub, Any, dict[str, Any]]) -> None:
    """A broken snapshot after a resync leaves nothing to start from: the page starts
    again (it stayed stale for good, or went live on the old document with the patches
    that followed)."""
    h, b, doc = paged
    board = "window.gputopBoard"
    wait(b, f"return {board}.conn === 'live'", "live before the patch", 15)
    b.execute_script("window.broken = 1")  # the next snapshot arrives as garbage
    _snapshots_through(b, """(e, fn) => window.broken-- > 0
        ? fn({data: "{not json", lastEventId: e.lastEventId}) : fn(e)""")
    try:
        b.execute_script(f"{board}.resyncRun = 0")
        before = b.execute_script(f"return [{board}.snapshots, {board}.resyncs]")
        _misfit(h, doc)
        wait(b, f"return {board}.snapshots > arguments[0] && {board}.conn === 'live'",
             "a good snapshot, then live", 20, before[0])
        assert b.execute_script(f"return [{board}.snapshots, {board}.resyncs]") == [
            before[0] + 1, before[1] + 2]  # the misfit's, then the broken snapshot's
    finally:
        _real_snapshots(b)


def test_after_the_watchdog_starts_again_the_page_waits_for_the_snapshot(
        paged: tuple[DocHub, Any, dict[str, Any]]) -> None:
    """The watchdog (no event for 30 s, and /-/healthy not answering) starts a new
    stream, as a resync does: the page is live again only with that stream's snapshot,
    not at the open stream's 1.5 s moment (it showed the old document as current)."""
    _, b, _ = paged
    board = "window.gputopBoard"
    wait(b, f"return {board}.conn === 'live'", "live", 15)
    _snapshots_through(b, "(e, fn) => setTimeout(() => fn(e), 6000)")
    b.execute_script("""window.realFetch = window.fetch;
        window.fetch = (url, ...rest) => String(url).includes("/-/healthy")
          ? Promise.reject(new Error("down")) : window.realFetch(url, ...rest);
        window.gputopBoard.lastHeard = Date.now() - 31000;""")
    try:
        before = b.execute_script(f"return {board}.snapshots")
        wait(b, f"return {board}.conn === 'stale'", "the watchdog's new stream", 10)
        b.execute_script("window.fetch = window.realFetch")
        wait(b, "return window.performance.now() > arguments[0]", "3 s", 5,
             b.execute_script("return window.performance.now()") + 3000)
        assert b.execute_script(f"return [{board}.conn, {board}.snapshots]") == [
            "stale", before]
        wait(b, f"return {board}.snapshots > arguments[0] && {board}.conn === 'live'",
             "the snapshot, then live", 15, before)
    finally:
        _real_snapshots(b)
        b.execute_script("window.fetch = window.realFetch")
