"""The wall screen (``?tv=1``) in headless Chromium at 1920x1080, against the hub's real app
holding a written document (tests/support/web_hub.py): a fleet of 50 hosts x 8 GPUs fits one page
with every host's label, the summary and the panels in sight; a down host is one line;
a far larger fleet pages; hostile names stay inside their tile."""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from tests.support.web_hub import (
    DocHub,
    browser,
    chromium_missing,
    fleet_doc,
    history_db,
    host_doc,
    set_size,
)

HOSTILE = "<img src=x onerror=alert(1)>"

#: What a person sees of the wall: the page's size, the indicator, each host's label.
READ = """
const r = document.scrollingElement;
const inView = (rc) => rc.width > 0 && rc.height > 0 && rc.top >= 0 && rc.left >= 0 &&
  rc.bottom <= innerHeight && rc.right <= innerWidth;
const hosts = {};
for (const e of document.querySelectorAll('.wall [data-host]')) {
  const n = e.querySelector('.tvname');
  hosts[e.dataset.host] = {
    down: e.classList.contains('tvdownline'), text: n.textContent,
    cut: n.scrollWidth > n.clientWidth, seen: inView(n.getBoundingClientRect()) &&
      !e.classList.contains('offpage'),
    lines: e.getBoundingClientRect().height / parseFloat(getComputedStyle(e).fontSize),
    top: e.getBoundingClientRect().top,
    load: e.querySelector('.tile .tl')?.textContent ?? null,
    width: e.getBoundingClientRect().width};
}
const tiles = [...document.querySelectorAll('.wall .tile')];
return {
  size: [r.scrollHeight, innerHeight, r.scrollWidth, innerWidth],
  page: document.getElementById('tvpage').textContent,
  bar: !document.getElementById('tvbar').hidden,
  hosts,
  tiles: tiles.length,
  tilesSeen: tiles.filter((t) => inView(t.getBoundingClientRect()) &&
    !t.closest('.offpage')).length,
  tileWidths: [...new Set(tiles.map((t) => t.getBoundingClientRect().width))],
  panels: ['summary', 'queue', 'people', 'waste'].map((id) => {
    const rc = document.getElementById(id).getBoundingClientRect();
    return rc.height > 0 && rc.top >= 0 && rc.bottom <= innerHeight;
  }),
  images: document.images.length,
};
"""


def wait(b: Any, script: str, what: str, seconds: float = 20.0, *args: Any) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        got = b.execute_script(script, *args)
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} in {seconds} s")
        time.sleep(0.05)


def read(b: Any) -> dict[str, Any]:
    return dict(b.execute_script(READ))


def wall(doc: dict[str, Any], directory: Path, query: str = "?tv=1"
         ) -> Iterator[tuple[DocHub, Any, dict[str, Any]]]:
    """A hub (with a day of history: the waste panel shows) and the wall at 1920x1080."""
    reason = chromium_missing()
    if reason:
        pytest.skip(reason)
    history_db(directory / "history.sqlite3")
    h = DocHub(doc, directory, history=True)
    b = browser(1920, 1080)
    try:
        set_size(b, 1920, 1080)
        b.get(h.url + query)
        wait(b, "return window.gputopBoard && window.gputopBoard.conn === 'live' && "
             "!document.getElementById('waste').hidden", "a live wall with its waste panel", 30)
        time.sleep(1.1)  # (the panels are drawn at most once a second)
        yield h, b, doc
    finally:
        b.quit()
        h.stop()


@pytest.fixture(scope="module")
def fifty(tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[DocHub, Any, dict[str, Any]]]:
    """50 hosts of 8 GPUs that answer (400 GPUs), and 2 down."""
    yield from wall(fleet_doc(52, 8, seed=5, failing=2), tmp_path_factory.mktemp("tv50"))


def test_fifty_hosts_of_eight_fit_one_page(fifty: tuple[DocHub, Any, dict[str, Any]]) -> None:
    _, b, doc = fifty
    got = read(b)
    height, inner_h, width, inner_w = got["size"]
    assert height <= inner_h and width <= inner_w, got["size"]  # no scrollbar either way
    assert got["page"] == "" and not got["bar"], got["page"]
    assert got["tiles"] == got["tilesSeen"] == 400
    names = [h["name"] for h in doc["hosts"]]
    assert sorted(got["hosts"]) == sorted(names)
    for name, host in got["hosts"].items():
        assert host["text"] == name and not host["cut"] and host["seen"], (name, host)
    assert got["panels"] == [True, True, True, True]


def test_a_down_host_is_one_line(fifty: tuple[DocHub, Any, dict[str, Any]]) -> None:
    h, b, doc = fifty
    now = datetime.now(timezone.utc)
    import random

    down = host_doc("gpu-030", 8, random.Random(1), now, ("timeout", "no answer in 10 s " * 20))
    doc["hosts"][30] = down
    h.publish([down])
    wait(b, "const e = document.querySelector('.tvdownline[data-host=\"gpu-030\"]');"
         " return e && e.isConnected", "gpu-030 as a down line")
    got = read(b)
    downs = {n: x for n, x in got["hosts"].items() if x["down"]}
    assert sorted(downs) == ["gpu-000", "gpu-001", "gpu-030"]
    for name, x in downs.items():
        assert x["lines"] < 2.2 and x["seen"], (name, x)  # one line of text, however long
    assert got["size"][0] <= got["size"][1] and got["page"] == ""
    assert got["tiles"] == got["tilesSeen"] == 392


def test_hostile_names_stay_inside_their_tile(fifty: tuple[DocHub, Any, dict[str, Any]]
                                              ) -> None:
    h, b, doc = fifty
    before = read(b)
    host = copy.deepcopy(doc["hosts"][20])
    g = host["gpus"][0]
    g["name"] = HOSTILE + "X" * 290
    g["processes"] = [{"pid": 7, "user": "u" * 64, "command": HOSTILE, "gpu_memory_mib": 900}]
    g["reservation"] = None
    g2 = host["gpus"][1]
    g2["reservation"] = {"id": "rx", "host": host["name"], "gpu": 1, "user": HOSTILE + "v" * 30,
                         "expires": None, "note": HOSTILE}
    g2["flags"] = ["<b>odd</b>" * 20]
    long_name = HOSTILE + "h" * 150  # (the page cuts names past 200)
    new = copy.deepcopy(doc["hosts"][21])
    new["name"] = long_name
    doc["hosts"][20] = host
    h.publish([host, new])
    wait(b, "return [...document.querySelectorAll('.wall .tvhost')].some("
         "(e) => e.dataset.host === arguments[0])", "the long-named host", 20, long_name)
    got = read(b)
    assert len(got["tileWidths"]) == 1 and got["tileWidths"] == before["tileWidths"]
    assert got["size"][2] <= got["size"][3], got["size"]
    widths = {round(x["width"]) for x in got["hosts"].values() if not x["down"]}
    assert len(widths) == 1, widths  # the long name is cut, its row no wider than the rest
    assert got["hosts"][long_name]["text"] == long_name and got["hosts"][long_name]["cut"]
    assert got["images"] == 0
    tiles = b.execute_script(
        "return [...document.querySelectorAll('.tvhost[data-host=\"gpu-020\"] .tile')]"
        ".slice(0, 2).map((t) => [t.querySelector('.tw').textContent, t.title])")
    assert tiles[0][0] == "u" * 64 and HOSTILE in tiles[0][1]
    assert tiles[1][0] == HOSTILE + "v" * 30 and "<b>odd</b>" in tiles[1][1]
    assert [e for e in b.get_log("browser") if e["level"] == "SEVERE"] == []


def test_a_far_larger_fleet_pages(tmp_path: Path) -> None:
    for h, b, _doc in wall(fleet_doc(200, 8, seed=9, failing=4), tmp_path, "?tv=1&every=3"):
        first = read(b)
        assert first["size"][0] <= first["size"][1], first["size"]
        # (a page turns every 3 s: on a loaded machine the first read may be past page 1)
        m = re.fullmatch(r"page (\d+) of (\d+)", first["page"])
        assert m and int(m.group(2)) >= 2 and first["bar"], first["page"]
        on_first = {n for n, x in first["hosts"].items() if x["seen"]}
        assert len(on_first) >= 50 or m.group(1) == m.group(2)  # (the last page: the rest)
        assert all(not x["cut"] for x in first["hosts"].values())
        assert first["panels"] == [True, True, True, True]
        # A host on the next page changes while it is not shown: its page shows it as it is
        # now (rows off the page are drawn when their page comes, not at each update).
        rows = [(x["top"], n) for n, x in first["hosts"].items() if not x["seen"] and not x["down"]]
        target = min([r for r in rows if r[0] > 0] or rows)[1]
        host = copy.deepcopy(next(x for x in _doc["hosts"] if x["name"] == target))
        load = 42 if host["gpus"][0]["utilization_percent"] != 42 else 43
        host["gpus"][0]["utilization_percent"] = load
        updates = b.execute_script("return window.gputopBoard.updates")
        h.publish([host])
        wait(b, "return window.gputopBoard.updates > arguments[0]", "the update", 10, updates)
        # Until its page comes round (a loaded machine may turn more than one page
        # between two looks: wait for the page, not for the next one).
        deadline = time.monotonic() + 30
        second = read(b)
        while not second["hosts"][target]["seen"] and time.monotonic() < deadline:
            time.sleep(0.2)
            second = read(b)
        on_second = {n for n, x in second["hosts"].items() if x["seen"]}
        assert on_second and not on_first & on_second
        assert target in on_second and second["hosts"][target]["load"] == str(load)
        assert second["size"][0] <= second["size"][1]
