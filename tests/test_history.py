"""History: the recorder's arithmetic on synthetic snapshots with an injected clock, rollups
against raw totals, hostile database files, and SIGKILL while recording.

(The recorded run against the real-sshd fleet is in test_history_fleet.py.)
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from gputop.history.db import HistoryDB, HistoryError
from gputop.history.recorder import Recorder
from gputop.history.report import collect, summarise
from gputop.model import GpuInfo, HostError, HostSnapshot, ProcessInfo
from gputop.reservations.state import StoreState
from gputop.reservations.terms import Target, Terms, new_reservation

ROOT = Path(__file__).resolve().parents[1]
T0 = datetime(2026, 11, 2, 8, 0, tzinfo=timezone.utc)
HOSTILE = "=cmd|' /C calc'!A0\x1b]0;pwned\x07"


def gpu(index: int, util: int | None, *users: str | None) -> GpuInfo:
    return GpuInfo(index=index, uuid=f"GPU-{index:04d}", name="H100",
                   utilization_percent=util, memory_used_mib=1000 if users else 0,
                   memory_total_mib=81559,
                   processes=tuple(ProcessInfo(pid=100 + i, user=u) for i, u in enumerate(users)))


def snap(name: str, t: datetime, *gpus: GpuInfo, down: bool = False) -> HostSnapshot:
    if down:
        return HostSnapshot(name=name, time=t, error=HostError("unreachable", "refused"))
    return HostSnapshot(name=name, time=t, gpus=tuple(gpus))


def reservations(*held: tuple[str, int, str]) -> StoreState:
    return StoreState(reservations=tuple(
        new_reservation(
            Target(h, g), Terms(86400 * 3, user=u, machine="m"), T0 - timedelta(hours=1))
        for h, g, u in held))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def open_recorder(path: Path, interval: float = 10.0, **kw: Any) -> Recorder:
    return Recorder(HistoryDB(path, writer=True), interval=interval, timeout=5.0,
                    clock=Clock(), **kw)


def report(path: Path, start: datetime, end: datetime) -> dict[str, Any]:
    with HistoryDB(path) as db:
        return summarise(collect(db, start.timestamp(), end.timestamp()))


def by(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    return {r[key]: r for r in rows}


def hours(seconds: float) -> float:
    return seconds / 3600


# --- the arithmetic --------------------------------------------------------------------


def drop_share_sums(c: sqlite3.Connection) -> None:
    """Take out the rollups' shares' sums (schema version 4): a database an older gputop
    wrote, for the upgrade tests."""
    for tier in ("minute", "hour", "day"):
        for col in ("shared", "shared_idle"):
            c.execute(f"ALTER TABLE user_{tier} DROP COLUMN {col}")


def test_per_user_numbers_shared_gpus_and_a_host_down(tmp_path: Path) -> None:
    """Ten-second samples over 10 minutes with known states; every number by hand."""
    db = tmp_path / "h.sqlite3"
    rec = open_recorder(db)
    rec.set_reservations(reservations(("a", 0, "alice"), ("a", 1, "bob"), ("b", 0, "carol")))
    for i in range(60):  # samples at T0+10 s ... T0+600 s, each standing for 10 s
        t = T0 + timedelta(seconds=10 * (i + 1))
        # a:0 alice busy all along on her own reservation; a:1 bob reserved, alice AND an
        # unknown owner share it at 50 % (not bob's: unreserved use); a:2 nobody, idle.
        rec.record(snap("a", t, gpu(0, 90, "alice"), gpu(1, 50, "alice", None), gpu(2, 0)))
        # b: first 20 samples bob holds memory at 0 % on carol's reservation, then b is down
        # for 20, then carol runs at 100 % for 20.
        if i < 20:
            rec.record(snap("b", t, gpu(0, 0, "bob")))
        elif i < 40:
            rec.record(snap("b", t, down=True))
        else:
            rec.record(snap("b", t, gpu(0, 100, "carol")))
    rec.flush()
    rec.db.close()
    doc = report(db, T0, T0 + timedelta(seconds=605))
    users = by(doc["users"], "user")
    a = pytest.approx
    assert users["alice"]["used_hours"] == a(hours(600 + 300))
    assert users["alice"]["unreserved_hours"] == a(hours(300))  # on bob's a:1
    assert users["alice"]["reserved_hours"] == a(hours(600))
    assert users["alice"]["reserved_idle_hours"] == 0
    assert users["alice"]["mean_utilization_used"] == a((90 * 600 + 50 * 300) / 900)
    assert users["?"]["used_hours"] == a(hours(300))
    assert users["bob"]["reserved_hours"] == a(hours(600))
    # his a:1 has an unknown owner's process: maybe his, so never counted idle
    assert users["bob"]["reserved_idle_hours"] == 0
    assert users["bob"]["used_hours"] == a(hours(200))
    assert users["bob"]["unreserved_hours"] == a(hours(200))  # on carol's b:0
    assert users["bob"]["held_idle_hours"] == a(hours(200))
    assert users["carol"]["reserved_hours"] == a(hours(600))
    # b:0 is carol's: bob's 200 s are not hers (idle), the 200 s down are not known to be
    # idle, her own 200 s are used
    assert users["carol"]["reserved_idle_hours"] == a(hours(200))
    assert users["carol"]["used_hours"] == a(hours(200))
    hosts = by(doc["hosts"], "host")
    assert hosts["b"]["no_data_hours"] == a(hours(200))
    assert hosts["b"]["gpu_hours"] == a(hours(600))
    assert hosts["b"]["busy_hours"] == a(hours(200))
    assert hosts["b"]["held_idle_hours"] == a(hours(200))
    assert hosts["a"]["idle_hours"] == a(hours(600))  # a:2
    assert hosts["a"]["busy_hours"] == a(hours(1200))
    hl = doc["headline"]
    total = 1800 + 400
    assert hl["gpu_hours"] == a(hours(total))
    assert hl["busy_percent"] == a(100 * (1200 + 200) / total)
    assert hl["idle_percent"] == a(100 * 600 / total)
    assert hl["held_idle_percent"] == a(100 * 200 / total)
    assert hl["no_data_hours"] == a(hours(200))
    # per-user used time adds up to the GPUs' used time: the shared GPU is split, not doubled
    assert sum(u["used_hours"] for u in doc["users"]) == a(hours(600 + 600 + 400))
    # the chart shows b's outage as a gap, never as 0 %
    series = doc["series"]["hosts"]["b"]
    step = doc["series"]["step_s"]
    assert series[300 // step] is None  # mid-outage
    assert series[100 // step] == 0 and series[500 // step] == 100


def test_a_gap_while_the_recorder_was_stopped_is_not_counted(tmp_path: Path) -> None:
    db = tmp_path / "h.sqlite3"
    rec = open_recorder(db)
    rec.record(snap("a", T0, gpu(0, 50, "alice")))
    rec.record(snap("a", T0 + timedelta(seconds=10), gpu(0, 50, "alice")))
    rec.record(snap("a", T0 + timedelta(hours=1), gpu(0, 50, "alice")))  # restarted
    rec.record(snap("a", T0 + timedelta(hours=1), gpu(0, 50, "alice")))  # duplicate: ignored
    rec.flush()
    rec.db.close()
    doc = report(db, T0 - timedelta(minutes=1), T0 + timedelta(hours=2))
    # 10 s (first sample) + 10 s + at most max(2 x interval, interval + timeout) = 20 s
    assert doc["users"][0]["used_hours"] == pytest.approx(hours(40))


def _busy_day(db: Path, **keep: float) -> Recorder:
    """Three hours of a small fleet at 30 s, with users coming and going, a host down and
    reservations: the same run for raw-only and rolled-up reports."""
    rec = open_recorder(db, interval=30.0, **keep)
    rec.set_reservations(reservations(("a", 1, "bob"), ("b", 0, "alice")))
    for i in range(360):
        t = T0 + timedelta(seconds=30 * i + 7)
        phase = (i // 17) % 4
        users = [("alice",), ("alice", "bob"), (), (None,)][phase]
        rec.record(snap("a", t, gpu(0, (i * 7) % 101, *users), gpu(1, 0 if phase else 60,
                                                                    *users[:1])))
        rec.record(snap("b", t, gpu(0, 3 * phase, "carol"), down=phase == 2))
    rec.flush()
    return rec


def _totals(doc: dict[str, Any]) -> dict[str, float]:
    out = {f"hl.{k}": v or 0.0 for k, v in doc["headline"].items()}
    for section, key in (("users", "user"), ("hosts", "host")):
        for r in doc[section]:
            for k, v in r.items():
                if isinstance(v, float):
                    out[f"{section}.{r[key]}.{k}"] = v
    return out


@pytest.mark.parametrize(("start_off", "end_off"), [(0, 4 * 3600), (1234, 3 * 3600 - 600),
                                                     (-86400 * 3, 86400 * 3),
                                                     (-86400 * 5, 86400 * 5)])
def test_rollups_give_the_totals_of_the_raw_samples(tmp_path: Path, start_off: int,
                                                    end_off: int) -> None:
    """The same three hours reported from raw samples, and from minute and hour rollups
    after the raw samples (and then the minutes) were dropped."""
    start, end = T0 + timedelta(seconds=start_off), T0 + timedelta(seconds=end_off)
    raw = tmp_path / "raw.sqlite3"
    _busy_day(raw).db.close()
    expected = _totals(report(raw, start, end))
    assert expected["users.alice.used_hours"] > 0

    rolled = tmp_path / "rolled.sqlite3"
    rec = _busy_day(rolled, raw_keep_s=600, minute_keep_s=3 * 3600)
    later = T0.timestamp() + 3 * 3600 + 3600 * 2  # two hours after the last sample
    rec.maintain(later)
    c = rec.db.conn
    assert c.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == 0
    assert c.execute("SELECT COUNT(*) FROM gpu_minute").fetchone()[0] > 0
    assert c.execute("SELECT COUNT(*) FROM gpu_hour").fetchone()[0] > 0
    got_minutes = _totals(report(rolled, start, end))
    rec.maintain(later + 86400)  # now the minutes are gone too: hours only
    assert c.execute("SELECT COUNT(*) FROM gpu_minute").fetchone()[0] == 0
    assert c.execute("SELECT COUNT(*) FROM gpu_day").fetchone()[0] > 0
    rec.db.close()
    got_hours = _totals(report(rolled, start, end))
    assert got_minutes == pytest.approx(expected_round(raw, start, end, end_out=False))
    assert got_hours == pytest.approx(expected_round(raw, start, end, end_out=True))


def expected_round(raw: Path, start: datetime, end: datetime, *, end_out: bool
                   ) -> dict[str, float]:
    """Where only hourly sums are left, a range is rounded out to whole hours."""
    def floor(t: datetime) -> datetime:
        return t.replace(minute=0, second=0, microsecond=0)

    ceil_end = end if end == floor(end) else floor(end) + timedelta(hours=1)
    return _totals(report(raw, floor(start), ceil_end if end_out else end))


def test_rollup_runs_in_steps_as_time_goes_on(tmp_path: Path) -> None:
    """maintain() called every few minutes while recording gives the same totals as one
    late call: no minute counted twice or lost at the edges."""
    once, steps = tmp_path / "once.sqlite3", tmp_path / "steps.sqlite3"
    _busy_day(once).db.close()
    rec = open_recorder(steps, interval=30.0, raw_keep_s=60, minute_keep_s=1800)
    rec.set_reservations(reservations(("a", 1, "bob"), ("b", 0, "alice")))
    src = Recorder  # same generator as _busy_day, interleaved with maintain()
    assert src
    for i in range(360):
        t = T0 + timedelta(seconds=30 * i + 7)
        phase = (i // 17) % 4
        users = [("alice",), ("alice", "bob"), (), (None,)][phase]
        rec.record(snap("a", t, gpu(0, (i * 7) % 101, *users), gpu(1, 0 if phase else 60,
                                                                    *users[:1])))
        rec.record(snap("b", t, gpu(0, 3 * phase, "carol"), down=phase == 2))
        if i % 9 == 0:
            rec.maintain(t.timestamp())
    rec.maintain(T0.timestamp() + 6 * 3600)
    rec.db.close()
    start, end = T0, T0 + timedelta(hours=4)
    assert _totals(report(steps, start, end)) == pytest.approx(_totals(report(once, start, end)))


# --- hostile files ---------------------------------------------------------------------


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gputop", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def _hostile_files(tmp_path: Path) -> dict[str, Path]:
    files = {}
    garbage = tmp_path / "garbage.sqlite3"
    garbage.write_bytes(os.urandom(8192))
    files["garbage"] = garbage
    good = tmp_path / "good.sqlite3"
    rec = open_recorder(good)
    rec.record(snap("a", T0, gpu(0, 50, "alice")))
    rec.flush()
    rec.db.close()
    truncated = tmp_path / "truncated.sqlite3"
    data = good.read_bytes()
    # the header and the first page survive, the tables' pages are scrambled
    truncated.write_bytes(data[:4096] + bytes(b ^ 0x5A for b in data[4096:]))
    files["corrupt"] = truncated
    newer = tmp_path / "newer.sqlite3"
    newer.write_bytes(data)
    c = sqlite3.connect(newer)
    c.execute("PRAGMA user_version = 99")
    c.close()
    files["newer"] = newer
    other = tmp_path / "other.sqlite3"
    c = sqlite3.connect(other)
    c.execute("CREATE TABLE t (x)")
    c.execute("PRAGMA user_version = 3")
    c.close()
    files["other"] = other
    plain = tmp_path / "plain.sqlite3"  # someone's database, no version at all
    c = sqlite3.connect(plain)
    c.execute("CREATE TABLE notes (x)")
    c.execute("INSERT INTO notes VALUES ('mine')")
    c.commit()
    c.close()
    files["plain"] = plain
    link = tmp_path / "link.sqlite3"
    link.symlink_to(good)
    files["symlink"] = link
    return files


@pytest.mark.parametrize("kind", ["garbage", "corrupt", "newer", "other", "plain",
                                  "symlink"])
def test_a_bad_database_is_an_error_naming_it_and_is_left_untouched(
        tmp_path: Path, kind: str) -> None:
    path = _hostile_files(tmp_path)[kind]
    before = path.read_bytes()
    listing = sorted(p.name for p in tmp_path.iterdir())
    r = _cli("report", "--db", str(path), "--since", "30d")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert str(path) in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    if kind == "newer":
        assert "newer gputop" in r.stderr
    with pytest.raises(HistoryError) as exc:  # the recorder refuses it too, before writing
        rec = HistoryDB(path, writer=True)
        Recorder(rec, interval=1.0).record(snap("a", T0, gpu(0, 1)))
    assert str(path) in str(exc.value)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith("writer-lock")) \
        == [n for n in listing if not n.endswith("writer-lock")]


def test_one_writer_per_database(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite3"
    first = HistoryDB(path, writer=True)
    try:
        with pytest.raises(HistoryError, match="another `gputop record`"):
            HistoryDB(path, writer=True)
    finally:
        first.close()
    HistoryDB(path, writer=True).close()


# --- SIGKILL -----------------------------------------------------------------------------

WRITER = r"""
import sys, time
from datetime import datetime, timedelta, timezone
from tests.test_history import gpu, snap, open_recorder, reservations, T0
rec = open_recorder(__import__("pathlib").Path({db!r}), interval=2.0, raw_keep_s=120,
                    minute_keep_s=600)
rec.commit_every = 0.0
rec.set_reservations(reservations(("h0", 0, "alice")))
start = {start}
print("ready", flush=True)
i = 0
while True:
    i += 1
    t = T0 + timedelta(seconds=start + 2 * i)
    for h in range(20):
        rec.record(snap(f"h{{h}}", t, *(gpu(g, (i + g) % 100, "alice", "bob") for g in range(8)),
                        down=(i + h) % 7 == 0))
    if i % 10 == 0:
        rec.maintain(t.timestamp() + 3600)
"""


def test_sigkill_while_recording_leaves_a_valid_database(tmp_path: Path) -> None:
    import random

    db = tmp_path / "h.sqlite3"
    rng = random.Random(12)
    counts = []
    for round_ in range(4):
        code = WRITER.format(db=str(db), start=100_000 * round_)
        # (run from the checkout's root, so ``tests`` imports as a package)
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[1])
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready", p.stderr.read() if p.stderr else ""
        time.sleep(rng.uniform(0.3, 1.2))
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        c = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        counts.append(c.execute("SELECT COUNT(*) FROM samples").fetchone()[0]
                      + c.execute("SELECT COUNT(*) FROM gpu_hour").fetchone()[0])
        c.close()
        r = _cli("report", "--db", str(db), "--from", "2026-01-01T00:00Z", "--to",
                 "2027-01-01T00:00Z", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["headline"]["gpu_hours"] > 0
    assert all(n > 0 for n in counts)


# --- the command -------------------------------------------------------------------------


@pytest.fixture
def recorded(tmp_path: Path) -> Path:
    db = tmp_path / "h.sqlite3"
    rec = open_recorder(db)
    rec.set_reservations(reservations(("gpu-01", 1, "bob")))
    for i in range(30):
        t = T0 + timedelta(seconds=10 * (i + 1))
        rec.record(snap("gpu-01", t, gpu(0, 80, "alice"), gpu(1, 0, HOSTILE)))
        rec.record(snap("gpu-02", t, gpu(0, 0), down=i >= 15))
    rec.flush()
    rec.db.close()
    return db


RANGE = ("--from", "2026-11-02T08:00Z", "--to", "2026-11-02T08:05Z")


def test_report_text_csv_json(recorded: Path, tmp_path: Path) -> None:
    r = _cli("report", "--db", str(recorded), *RANGE)
    assert r.returncode == 0, r.stderr
    assert "of 0.20 GPU-hours" in r.stdout  # 2 x 290 s + 150 s up (the 08:05 samples are out)
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout
    lines = r.stdout.splitlines()
    assert any(ln.startswith("alice") for ln in lines)
    assert any(ln.startswith("fleet") for ln in lines)
    r = _cli("report", "--db", str(recorded), *RANGE, "--csv")
    assert r.returncode == 0, r.stderr
    rows = r.stdout.splitlines()
    assert rows[0].startswith("user,used_hours,reserved_hours,reserved_idle_hours")
    hostile = [ln for ln in rows if "calc" in ln]
    assert hostile and hostile[0].startswith("'=cmd")  # no formula for a spreadsheet
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout
    r = _cli("report", "--db", str(recorded), *RANGE, "--by", "host", "--csv")
    hosts = {ln.split(",")[0]: ln.split(",") for ln in r.stdout.splitlines()[1:]}
    assert float(hosts["gpu-02"][6]) == pytest.approx(hours(140), abs=1e-6)  # 08:05 is out
    r = _cli("report", "--db", str(recorded), *RANGE, "--by", "gpu", "--json")
    doc = json.loads(r.stdout)
    assert doc["headline"]["no_data_hours"] == pytest.approx(hours(140))
    assert {g["host"] for g in doc["gpus"]} == {"gpu-01", "gpu-02"}


def test_report_plot(recorded: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "r.png"
    r = _cli("report", "--db", str(recorded), *RANGE, "--plot", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_plot_without_matplotlib_says_how_to_add_it(recorded: Path,
                                                            tmp_path: Path) -> None:
    """gputop is installed from a checkout (pipx, a venv): the hint must not send people to
    `pip install 'gputop[plot]'`, an index's package of that name. matplotlib is made
    unimportable for this one process (it may be installed here)."""
    out = tmp_path / "r.png"
    r = subprocess.run([sys.executable, "-c",
                        "import sys; sys.modules['matplotlib'] = None; "
                        "from gputop.cli import main; sys.exit(main(sys.argv[1:]))",
                        "report", "--db", str(recorded), *RANGE, "--plot", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and not out.exists()
    assert "pipx inject gputop matplotlib" in r.stderr, r.stderr
    assert "pip install '.[plot]' in the checkout" in r.stderr
    assert "gputop[plot]" not in r.stderr


@pytest.mark.parametrize(("args", "words"), [
    (("--since", "7x"), "--since 7x"),
    (("--from", "yesterday"), "--from yesterday"),
    (("--since", "1d", "--from", "2026-11-01"), "not both"),
    (("--from", "2026-11-02", "--to", "2026-11-01"), "before"),
    (("--plot", "x.pdf"), ".png or .svg"),
])
def test_report_usage_errors(recorded: Path, args: tuple[str, ...], words: str) -> None:
    r = _cli("report", "--db", str(recorded), *args)
    assert r.returncode == 2 and words in r.stderr, r.stderr


def test_report_without_a_database_says_how_to_start(tmp_path: Path) -> None:
    r = _cli("report", "--db", str(tmp_path / "none.sqlite3"))
    assert r.returncode == 2 and "gputop record" in r.stderr
    assert not (tmp_path / "none.sqlite3").exists()


def test_the_example_systemd_unit_ships_with_the_package() -> None:
    import gputop.history

    unit = Path(gputop.history.__file__).parent / "gputop-record.service"
    text = unit.read_text()
    assert "ExecStart=" in text and "gputop record" in text
    assert "RestartPreventExitStatus=2" in text and "[Install]" in text
    assert "history/*.service" in (ROOT / "pyproject.toml").read_text()


def record_recent(db: Path, host: str, uuid: str, index: int) -> float:
    """Two hours up to now at 30 s: 40 % load for the first 90 minutes, then the host is
    down for the last 30; rolled up. Returns now."""
    now = time.time()
    rec = open_recorder(db, interval=30.0)
    start = now - 7200
    for i in range(240):
        t = datetime.fromtimestamp(start + 30 * (i + 1), timezone.utc)
        g = GpuInfo(index=index, uuid=uuid, utilization_percent=40, processes=(
            ProcessInfo(pid=1, user="alice"),))
        rec.record(snap(host, t, g, down=i >= 180))
    rec.maintain(now + 120)
    rec.db.close()
    return now


def test_recent_gpu_reads_the_last_hour_and_day(tmp_path: Path) -> None:
    from gputop.history.recent import recent_gpu

    db = tmp_path / "h.sqlite3"
    now = record_recent(db, "gpu-h100", "GPU-00000000-test", 0)
    got = recent_gpu(db, "gpu-h100", "GPU-00000000-test", 0, now)
    assert got is not None
    hour, day = got
    # the last hour: 30 minutes up at 40 %, 30 minutes down (no data, not 0 %)
    assert hour.mean_utilization == pytest.approx(40)
    assert hour.hours == pytest.approx(0.5, abs=1 / 60 + 0.01)
    assert hour.no_data_hours == pytest.approx(0.5, abs=1 / 60 + 0.01)
    assert hour.busy == pytest.approx(1)
    assert day.hours == pytest.approx(1.5, abs=1 / 60 + 0.01)
    assert "no data" in hour.line("last hour")
    assert recent_gpu(db, "gpu-h100", "GPU-other", 1, now) is None
    assert recent_gpu(tmp_path / "none.sqlite3", "gpu-h100", None, 0, now) is None
    from gputop.history.recent import recent_host

    host = recent_host(db, "gpu-h100", now)
    assert host is not None and host[0] == hour
    assert recent_host(db, "elsewhere", now) is None
