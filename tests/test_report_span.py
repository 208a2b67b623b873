"""The report's header on a short record and one with a gap: it gives the span it has data
for and names the time no recorder ran, instead of the range asked and "0.00 GPU-hours with
no data" (time without a recorder is not counted at all, so it is not "no data")."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from tests.test_history import T0, gpu, open_recorder, snap

#: A 1 h range: 07:40 to 08:40 UTC. The recorder ran 08:00-08:10 and 08:30-08:38.
RANGE = ("--from", "2026-11-02T07:40Z", "--to", "2026-11-02T08:40Z")


def _record(path: Path, *, rolled_up: bool) -> None:
    rec = open_recorder(path)  # every 10 s
    for start, minutes in ((0, 10), (30, 8)):
        for i in range(minutes * 6):
            t = T0 + timedelta(minutes=start, seconds=10 * (i + 1 if start == 0 else i))
            rec.record(snap("gpu-01", t, gpu(0, 50, "alice"), gpu(1, 0)))
    rec.flush()
    if rolled_up:  # the minutes as sums, as a recorder running an hour later has them
        rec.maintain((T0 + timedelta(minutes=45)).timestamp())
    rec.db.close()


def _report(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TZ": "UTC"}
    return subprocess.run([sys.executable, "-m", "gputop", "report", "--db", str(path),
                           *RANGE, *args], capture_output=True, text=True, timeout=60,
                          env=env)


def _at(iso: str) -> datetime:
    return datetime.fromisoformat(iso.replace("Z", "+00:00"))


@pytest.mark.parametrize("rolled_up", [False, True], ids=["raw", "minutes"])
def test_the_header_gives_the_recorded_span_and_names_the_gap(tmp_path: Path,
                                                              rolled_up: bool) -> None:
    db = tmp_path / "h.sqlite3"
    _record(db, rolled_up=rolled_up)
    doc = json.loads(_report(db, "--json").stdout)
    assert (doc["from"], doc["to"]) == ("2026-11-02T07:40:00Z", "2026-11-02T08:40:00Z")
    rec = doc["recorded"]
    assert _at(rec["from"]) == T0
    # the last sample, or its minute's end where minute sums answer
    assert (T0 + timedelta(minutes=37, seconds=50) <= _at(rec["to"])
            <= T0 + timedelta(minutes=38)), rec
    (gap,) = rec["gaps"]
    # (where minute sums answer, to the minute: the sample at 08:10:00 is in 08:10's)
    assert T0 + timedelta(minutes=10) <= _at(gap["from"]) <= T0 + timedelta(minutes=11), gap
    # the first sample after the restart stands for the 20 s before it (max_gap)
    assert (T0 + timedelta(minutes=29, seconds=40) <= _at(gap["to"])
            <= T0 + timedelta(minutes=30)), gap
    r = _report(db)
    assert r.returncode == 0, r.stderr
    head = r.stdout.splitlines()
    assert head[0].startswith("GPU-hours from 2026-11-02 08:00 to 2026-11-02 08:3"), head[0]
    # 18 minutes and 10 s, a minute more where minute sums answer (see above)
    assert re.search(r"\(local time\): recorded 1[89]m of the 1h00m asked \(from "
                     r"2026-11-02 07:40 to 2026-11-02 08:40\)$", head[0]), head[0]
    assert head[1].startswith("not recorded from 2026-11-02 08:1"), head[1]
    assert " to 2026-11-02 08:29 (" in head[1] or " to 2026-11-02 08:30 (" in head[1], head[1]
    assert head[1].endswith("no recorder was running"), head[1]
    assert "GPU-hours with no data while recording" in head[2]


def test_a_range_recorded_throughout_reads_as_asked(tmp_path: Path) -> None:
    """Inside the time the recorder ran: the range asked, no gap (a refresh late by less
    than a few intervals is none)."""
    db = tmp_path / "h.sqlite3"
    _record(db, rolled_up=False)
    r = subprocess.run([sys.executable, "-m", "gputop", "report", "--db", str(db), "--from",
                        "2026-11-02T08:01Z", "--to", "2026-11-02T08:09:55Z", "--json"],
                       capture_output=True, text=True, timeout=60)
    doc = json.loads(r.stdout)
    assert doc["recorded"] == {"from": doc["from"], "to": doc["to"], "gaps": []}


def test_a_gap_inside_a_range_recorded_to_both_edges_is_named(tmp_path: Path) -> None:
    db = tmp_path / "h.sqlite3"
    _record(db, rolled_up=False)
    r = subprocess.run([sys.executable, "-m", "gputop", "report", "--db", str(db), "--from",
                        "2026-11-02T08:00Z", "--to", "2026-11-02T08:38Z"], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "TZ": "UTC"})
    head = r.stdout.splitlines()
    assert head[0] == ("GPU-hours from 2026-11-02 08:00 to 2026-11-02 08:38 (local time): "
                       "recorded 18m of the 38m asked (from 2026-11-02 08:00 to 2026-11-02 "
                       "08:38)"), head[0]
    assert head[1] == ("not recorded from 2026-11-02 08:10 to 2026-11-02 08:29 (20m): no "
                       "recorder was running"), head[1]
