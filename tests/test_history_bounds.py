"""History stays bounded and the report truthful whatever arrives: a new user name every
refresh (forged holders in the shared file, new process owners), many names that each stay
a little, the chart of time recorded without a break, hosts down the whole time, and the
keep windows. Synthetic snapshots with an injected clock; the same against real sshd hosts
is in test_history_fleet.py."""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from gputop.history.names import (
    MAX_NAMED,
    NEW_GPU_EVERY_S,
    NEW_GPUS_BURST,
    NEW_NAMES_BURST,
    OTHER_NAMES,
)
from gputop.history.render import write_text
from gputop.reservations.state import StoreState
from gputop.reservations.terms import Target, Terms, new_reservation
from tests.test_history import T0, drop_share_sums, gpu, hours, open_recorder, report, snap

OTHERS = OTHER_NAMES


def held(t: datetime, *what: tuple[str, int, str]) -> StoreState:
    return StoreState(reservations=tuple(
        new_reservation(Target(h, g), Terms(3600, user=u, machine="m"), t - timedelta(minutes=1))
        for h, g, u in what))


def count(db: Path, sql: str) -> int:
    c = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return int(c.execute(sql).fetchone()[0])
    finally:
        c.close()


def most_per_bucket(db: Path, table: str) -> int:
    return count(db, f"SELECT COALESCE(MAX(n), 0) FROM (SELECT COUNT(*) AS n FROM {table} "
                     "GROUP BY b, gpu)")


def users_of(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {u["user"]: u for u in doc["users"]}


def test_a_new_name_every_refresh_adds_no_rows(tmp_path: Path) -> None:
    """Every refresh a new forged holder of a:0 and a new owner on a:1, for 2 h 47 min at
    2 s: no name of theirs is kept, their time is all there under (other names), and the
    report has as many lines as after one refresh."""
    db = tmp_path / "h.sqlite3"
    rec = open_recorder(db, interval=2.0)
    n = 5000
    for i in range(n):
        t = T0 + timedelta(seconds=2 * (i + 1))
        rec.set_reservations(held(t, ("a", 0, f"forged{i}")))
        rec.record(snap("a", t, gpu(0, 50, "alice"), gpu(1, 80, f"x{i}")))
        if i % 30 == 0:
            rec.maintain(t.timestamp())
    end = T0 + timedelta(seconds=2 * n)
    rec.maintain(end.timestamp() + 2 * 86400)
    rec.db.close()
    assert count(db, "SELECT COUNT(*) FROM users") == 2  # alice, (other names)
    for table in ("user_minute", "user_hour", "user_day"):
        assert count(db, f"SELECT COUNT(DISTINCT user) FROM {table}") == 2, table
    doc = report(db, T0, end + timedelta(seconds=1))
    users = users_of(doc)
    assert set(users) == {"alice", OTHERS}
    a = pytest.approx
    assert users[OTHERS]["reserved_hours"] == a(hours(2 * n))  # every forged holder's
    assert users[OTHERS]["used_hours"] == a(hours(2 * n))  # every new owner's
    assert users["alice"]["used_hours"] == a(hours(2 * n))
    assert users["alice"]["unreserved_hours"] == a(hours(2 * n))  # a:0 was never hers
    text = tmp_path / "r.txt"
    with text.open("w") as f:
        write_text(doc, "user", f)
    assert len(text.read_text().splitlines()) < 25


def test_a_name_that_stays_is_kept_from_its_first_refresh(tmp_path: Path) -> None:
    """bob appears and stays: every second of his counts as his, the first refresh too
    (it is written again once he is kept); a name seen once is not kept."""
    db = tmp_path / "h.sqlite3"
    rec = open_recorder(db, interval=10.0)
    for i in range(30):
        t = T0 + timedelta(seconds=10 * (i + 1))
        rec.set_reservations(held(t, ("a", 1, "carol")) if i >= 10 else None)
        users = ["alice"] + (["bob"] if i >= 5 else []) + (["flash"] if i == 20 else [])
        rec.record(snap("a", t, gpu(0, 60, *users), gpu(1, 0)))
    rec.flush()
    rec.db.close()
    doc = report(db, T0, T0 + timedelta(seconds=301))
    users = users_of(doc)
    assert "flash" not in users
    assert count(db, "SELECT COUNT(*) FROM users WHERE name = 'flash'") == 0
    a = pytest.approx
    # 5 samples alice alone, 24 with bob (5 s each), one with bob and flash (10/3 s each)
    assert users["alice"]["used_hours"] == a(hours(5 * 10 + 24 * 5 + 10 / 3))
    assert users["bob"]["used_hours"] == a(hours(24 * 5 + 10 / 3))
    assert users[OTHERS]["used_hours"] == a(hours(10 / 3))
    assert users["carol"]["reserved_hours"] == a(hours(200))
    assert users["carol"]["reserved_idle_hours"] == a(hours(200))


def test_many_names_that_each_stay_a_while_are_bounded(tmp_path: Path) -> None:
    """A new name every third refresh, each staying three refreshes, on one GPU for 2 h at
    2 s (1,200 names): names are admitted at most the burst and then one a minute, and no
    GPU's minute, hour or day has more than MAX_NAMED names of its own; nothing is lost."""
    db = tmp_path / "h.sqlite3"
    rec = open_recorder(db, interval=2.0)
    n = 3600
    for i in range(n):
        t = T0 + timedelta(seconds=2 * (i + 1))
        rec.record(snap("a", t, gpu(0, 70, f"n{i // 3}", f"m{(i + 1) // 3}")))
        if i % 30 == 0:
            rec.maintain(t.timestamp())
    end = T0 + timedelta(seconds=2 * n)
    rec.maintain(end.timestamp() + 2 * 86400)
    rec.db.close()
    kept = count(db, "SELECT COUNT(*) FROM users") - 1
    assert kept <= NEW_NAMES_BURST + 2 * n / 60 + 1
    for table in ("user_minute", "user_hour", "user_day"):
        assert most_per_bucket(db, table) <= MAX_NAMED + 1, table
    doc = report(db, T0, end + timedelta(seconds=1))  # from minutes: every name kept
    assert sum(u["used_hours"] for u in doc["users"]) == pytest.approx(hours(2 * n))
    doc = report(db, T0 - timedelta(days=3), T0 + timedelta(days=4))  # from the day's sums
    assert sum(u["used_hours"] for u in doc["users"]) == pytest.approx(hours(2 * n))
    assert len(doc["users"]) <= MAX_NAMED + 1


def test_the_chart_has_no_blank_column_where_recording_did_not_stop(tmp_path: Path) -> None:
    """An hour at 2 s, rolled up: ranges that start inside a minute (and a 30-minute one,
    where the columns were 30 s wide and minute sums filled every other one) have a value
    in every column from the first recorded second to the end, and the totals of the raw
    samples."""
    db = tmp_path / "h.sqlite3"
    rec = open_recorder(db, interval=2.0)
    first = T0 + timedelta(seconds=17)
    n = 1800
    for i in range(n):
        t = first + timedelta(seconds=2 * (i + 1))
        rec.record(snap("a", t, gpu(0, 50, "alice")))
        if i % 10 == 0:
            rec.maintain(t.timestamp())
    end = first + timedelta(seconds=2 * n)
    rec.maintain(end.timestamp())
    assert count(db, "SELECT COUNT(*) FROM gpu_minute") > 50
    for span in (1800, 2900, 3600):
        start = end - timedelta(seconds=span)
        doc = report(db, start, end)
        line = doc["series"]["hosts"]["a"]
        assert all(v == pytest.approx(50) for v in line), (span, line)
        # the totals are the samples' in the range, to the sample (2 s)
        assert users_of(doc)["alice"]["used_hours"] == pytest.approx(hours(span), abs=hours(2))
        origin = datetime.fromisoformat(doc["series"]["start"].replace("Z", "+00:00"))
        assert origin <= start < origin + timedelta(seconds=doc["series"]["step_s"])
    rec.db.close()


def test_hourly_columns_start_on_the_hour(tmp_path: Path) -> None:
    """14 hours at 60 s, rolled up into hours: a range over 12 h draws one column per hour,
    each a whole UTC hour, all filled; the first column is the hour the range starts in."""
    db = tmp_path / "h.sqlite3"
    rec = open_recorder(db, interval=60.0)
    for i in range(14 * 60):
        t = T0 + timedelta(seconds=60 * (i + 1))
        rec.record(snap("a", t, gpu(0, 20 + ((i + 1) // 60) * 5, "alice")))
    end = T0 + timedelta(hours=14)
    rec.maintain(end.timestamp() + 3600)
    rec.db.close()
    start = T0 + timedelta(minutes=37)
    doc = report(db, start, end)
    assert doc["series"]["step_s"] == 3600
    assert doc["series"]["start"] == "2026-11-02T08:00:00Z"
    line = doc["series"]["hosts"]["a"]
    assert len(line) == 14 and None not in line
    # whole hours are exact: the hour from 09:00 has 25 % load all along
    assert line[1] == pytest.approx(25) and line[13] == pytest.approx(85)


def test_a_host_down_all_along_is_in_the_report(tmp_path: Path) -> None:
    """b is down from the start (no GPU of it ever seen): reported as host-hours with no data
    and GPUs unknown, not as GPU-hours; c was up before and is down the whole range: its
    known GPUs count as GPU-hours with no data."""
    db = tmp_path / "h.sqlite3"
    rec = open_recorder(db, interval=10.0)
    rec.record(snap("c", T0, gpu(0, 10), gpu(1, 10)))  # before the range
    for i in range(60):
        t = T0 + timedelta(seconds=10 * (i + 1))
        rec.record(snap("a", t, gpu(0, 50, "alice")))
        rec.record(snap("b", t, down=True))
        rec.record(snap("c", t, down=True))
    rec.flush()
    rec.db.close()
    doc = report(db, T0 + timedelta(seconds=1), T0 + timedelta(seconds=601))
    hosts = {h["host"]: h for h in doc["hosts"]}
    assert set(hosts) == {"a", "b", "c"}
    a = pytest.approx
    assert hosts["b"]["gpus"] is None and hosts["b"]["gpu_hours"] == 0
    assert hosts["b"]["unknown_gpus_hours"] == a(hours(600))
    assert hosts["c"]["gpus"] == 2 and hosts["c"]["no_data_hours"] == a(2 * hours(600))
    assert hosts["a"]["unknown_gpus_hours"] == 0
    hl = doc["headline"]
    assert hl["no_data_hours"] == a(2 * hours(600))  # c's two GPUs; b is not GPU-hours
    assert hl["unknown_gpus_hours"] == a(hours(600)) and hl["hosts_with_unknown_gpus"] == 1
    assert {g["host"] for g in doc["gpus"]} == {"a", "c"}
    assert doc["series"]["hosts"]["b"] == [None] * len(doc["series"]["fleet"])
    text = tmp_path / "r.txt"
    with text.open("w") as f:
        write_text(doc, "host", f)
    out = text.read_text()
    assert "1 host(s) down before any of their GPUs was seen" in out
    assert "b: down 0.17 h before any of its GPUs was seen" in out


def test_hourly_sums_are_dropped_after_keep_hours(tmp_path: Path) -> None:
    """With keep_hours, hours older than it go once their days are summed; a report over
    that time reads the days, rounded out to whole days, with the same totals."""
    db = tmp_path / "h.sqlite3"
    rec = open_recorder(db, interval=600.0, raw_keep_s=3600, minute_keep_s=86400,
                        hour_keep_s=86400)
    day0 = datetime(2026, 11, 2, tzinfo=timezone.utc)
    for i in range(6 * 24 * 3):  # three days at 10 minutes
        t = day0 + timedelta(seconds=600 * (i + 1))
        rec.record(snap("a", t, gpu(0, 40, "alice")))
    rec.maintain((day0 + timedelta(days=3, hours=2)).timestamp())
    c = rec.db.conn
    # hours of the days before now - 1 d are gone; those days are summed
    assert c.execute("SELECT MIN(b) FROM gpu_hour").fetchone()[0] == (
        day0 + timedelta(days=2)).timestamp()
    assert c.execute("SELECT MIN(b) FROM user_hour").fetchone()[0] == (
        day0 + timedelta(days=2)).timestamp()
    assert c.execute("SELECT COUNT(*) FROM gpu_day").fetchone()[0] == 3
    rec.db.close()
    doc = report(db, day0 + timedelta(hours=5), day0 + timedelta(days=1, hours=3))
    # rounded out to the two whole days the range touches (the first from 00:10 on)
    assert users_of(doc)["alice"]["used_hours"] == pytest.approx(48 - 1 / 6)
    assert doc["series"]["step_s"] == 86400


def test_a_version_2_database_migrates_and_keeps_its_numbers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What gputop wrote before bounded history (version 2: no '(other names)', no
    'hour_from') reads as it is, and the writer takes it to version 3 with the same
    numbers; a gputop that reads up to version 2 refuses the file then (as 'newer')."""
    from gputop.history.db import SCHEMA_VERSION

    db = tmp_path / "h.sqlite3"
    rec = open_recorder(db)
    for i in range(6):
        rec.record(snap("m", T0 + timedelta(seconds=10 * (i + 1)), gpu(0, 50, "alice")))
    rec.flush()
    rec.db.close()
    c = sqlite3.connect(db)
    c.execute("DELETE FROM meta WHERE key = 'hour_from'")
    c.execute("DELETE FROM users WHERE name = ?", (OTHERS,))
    drop_share_sums(c)  # nor the shares' sums (version 4)
    c.execute("PRAGMA user_version = 2")
    c.commit()
    c.close()
    before = report(db, T0, T0 + timedelta(seconds=65))
    assert users_of(before)["alice"]["used_hours"] == pytest.approx(hours(60))
    rec = open_recorder(db)
    assert rec.db.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
    assert rec.db.conn.execute("SELECT COUNT(*) FROM users WHERE name = ?",
                               (OTHERS,)).fetchone()[0] == 1
    assert rec.db.conn.execute("SELECT COUNT(*) FROM meta WHERE key = 'hour_from'"
                               ).fetchone()[0] == 1
    rec.record(snap("m", T0 + timedelta(seconds=70), gpu(0, 50, "alice", "bob")))
    rec.flush()
    rec.db.close()
    users = users_of(report(db, T0, T0 + timedelta(seconds=75)))
    assert users["alice"]["used_hours"] == pytest.approx(hours(65))
    assert users[OTHERS]["used_hours"] == pytest.approx(hours(5))  # bob, seen once
    import gputop.history.db as schema

    monkeypatch.setattr(schema, "SCHEMA_VERSION", 2)  # what a version-2 gputop checks
    with pytest.raises(schema.HistoryError, match="newer gputop"):
        schema.check_file(db)


def test_the_names_waiting_for_a_second_refresh_are_bounded() -> None:
    """A flood of new names in one refresh: at most PENDING_MAX wait in memory, the rest
    count under (other names) at once; names not seen again are forgotten."""
    from gputop.history.names import PENDING_MAX, NameGate

    ids: dict[str, int] = {}
    gate = NameGate(ids, lambda n: len(ids) + 1, interval_ms=2000, max_gap_ms=4000)
    got = gate.user_ids([f"n{i}" for i in range(PENDING_MAX + 500)], 1000)
    assert got == [ids[OTHERS]] * (PENDING_MAX + 500)
    assert len(gate._pending) == PENDING_MAX and set(ids) == {OTHERS}
    gate.purge(1000 + 4001)
    assert not gate._pending
    # a name seen at 1000 and again a refresh later is kept; the others are not
    gate.user_ids(["bob"], 10_000)
    assert gate.user_ids(["bob", "new"], 12_000) == [ids["bob"], ids[OTHERS]]


def test_a_host_reporting_new_gpu_uuids_every_refresh_is_admitted_at_a_bounded_rate(
        tmp_path: Path) -> None:
    """A lying host: 64 new uuids every second for 70 s (4,480 uuids, a row each in
    ``gpus`` before), then an hour more. Its first answer's GPUs are all kept; after that
    one new GPU an hour, and the honest host beside it loses nothing."""
    db = tmp_path / "h.sqlite3"
    rec = open_recorder(db, interval=1.0)
    honest = [gpu(0, 10, "alice"), gpu(1, 20)]
    for i in range(70):
        t = T0 + timedelta(seconds=i + 1)
        lies = [replace(gpu(k, 50), uuid=f"GPU-lie-{i}-{k}") for k in range(64)]
        rec.record(snap("liar", t, *lies))
        rec.record(snap("good", t, *honest))
    rec.flush()
    assert count(db, "SELECT COUNT(*) FROM gpus g JOIN hosts h ON g.host = h.id "
                     "WHERE h.name = 'liar'") == NEW_GPUS_BURST
    for i in range(70, 70 + 3600, 60):  # an hour later, a minute apart: one more
        t = T0 + timedelta(seconds=i + 1)
        rec.record(snap("liar", t, *[replace(gpu(k, 50), uuid=f"GPU-lie-{i}-{k}")
                                     for k in range(64)]))
    rec.flush()
    rec.db.close()
    liar = count(db, "SELECT COUNT(*) FROM gpus g JOIN hosts h ON g.host = h.id "
                     "WHERE h.name = 'liar'")
    assert liar == NEW_GPUS_BURST + 3600 // int(NEW_GPU_EVERY_S)
    assert count(db, "SELECT COUNT(*) FROM gpus g JOIN hosts h ON g.host = h.id "
                     "WHERE h.name = 'good'") == 2
