"""The reservation commands as a script (or a teammate) runs them, against the real fleet.

Teammates are real users (gtalice, gtbob): gputop runs with their uid, so "whose is it"
is decided the way it is on a real server, not by environment variables.
"""

from __future__ import annotations

import json
import os
import pwd
import re
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gputop.history.db import HistoryDB
from gputop.history.recorder import Recorder
from gputop.model import GpuInfo, HostSnapshot, iso, utcnow
from gputop.reservations.state import StoreState
from gputop.reservations.store import Store
from gputop.reservations.terms import Target, Terms, new_reservation
from tests.support.as_user import need_test_users, run_as, shared_tmp, team_dir, user_home
from tests.support.fleet import Fleet


@pytest.fixture
def gputop(fleet: Fleet) -> Iterator[Any]:
    """Run ``gputop`` as a given teammate against the fleet with a fresh shared file."""
    need_test_users()
    with shared_tmp() as tmp:
        yield _runner(fleet, tmp)


def _runner(fleet: Fleet, tmp_path: Path) -> Any:
    res = team_dir(tmp_path) / "reservations.json"
    # The healthy hosts only, with a timeout a loaded machine cannot hit: these tests are
    # about reservations (host faults have their own tests), and no call waits on a hang.
    cfg = fleet.write_config(["gpu-h100", "gpu-mixed", "gpu-lost"], timeout=20.0)
    text = cfg.read_text().replace(str(fleet.root / "reservations.json"), str(res))
    cfg = tmp_path / "hosts.toml"
    cfg.write_text(text)
    cfg.chmod(0o644)
    homes = {u: user_home(fleet, tmp_path, u) for u in ("gtalice", "gtbob")}

    def run(*args: str, user: str = "gtalice", **env: str) -> Any:
        e = fleet.env() | {"HOME": str(homes[user]), "USER": user, "LOGNAME": user,
                           "TZ": "UTC"} | env
        return run_as(user, ["--config", str(cfg), *args], e, tmp_path)

    run.path = res  # type: ignore[attr-defined]
    run.config = cfg  # type: ignore[attr-defined]
    return run


def only(gputop: Any, *hosts: str) -> None:
    """Keep just these (healthy) hosts in the config, with a timeout that survives a loaded
    machine: a quick ``--json`` that never waits for the hosts that time out."""
    keep = "|".join(re.escape(h) for h in hosts)
    pattern = r'\[\[hosts\]\]\nname = "(?!(?:' + keep + r')")[^"]*"\n\n'
    text = re.sub(pattern, "", gputop.config.read_text())
    gputop.config.write_text(re.sub(r"(?m)^timeout = .*$", "timeout = 20.0", text))


def held(gputop: Any) -> list[tuple[str, int, str]]:
    doc = json.loads(gputop.path.read_text())
    return [(r["host"], r["gpu"], r["user"]) for r in doc["reservations"]]


def test_reserve_list_and_conflict(gputop: Any) -> None:
    r = gputop("reserve", "gpu-h100:0,1", "--for", "2h", "--note", "sweep [bold]7[/]")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("reserved gpu-h100:") == 2
    listed = json.loads(gputop("reservations", "--json", user="gtbob").stdout)["reservations"]
    assert [(x["host"], x["gpu"], x["user"]) for x in listed] == [
        ("gpu-h100", 0, "gtalice"), ("gpu-h100", 1, "gtalice")]
    assert listed[0]["uuid"].startswith("GPU-")  # recorded from the live host
    assert listed[0]["note"] == "sweep [bold]7[/]"
    clash = gputop("reserve", "gpu-h100:1", user="gtbob")
    assert clash.returncode == 1
    assert "gtalice" in clash.stderr and "sweep [bold]7[/]" in clash.stderr
    assert "until" in clash.stderr
    plain = gputop("reservations", user="gtbob").stdout
    assert "gpu-h100:0" in plain and "gtalice" in plain


def test_reserving_a_gpu_someone_else_uses_warns(gputop: Any) -> None:
    # gpu-h100:0 runs gtalice's job, gpu-h100:1 gtbob's, gpu-mixed:2 nothing.
    r = gputop("reserve", "gpu-h100:0", "gpu-h100:1", "gpu-mixed:2")
    assert r.returncode == 0, r.stderr
    warnings = [ln for ln in r.stderr.splitlines() if "warning" in ln]
    assert warnings == ["gputop: warning: gpu-h100:1 is in use by gtbob; reserving it anyway"]


def test_unknown_host_and_gpu_list_the_valid_ones(gputop: Any) -> None:
    r = gputop("reserve", "nope:0")
    assert r.returncode == 2 and "gpu-h100" in r.stderr and "gpu-mixed" in r.stderr
    r = gputop("reserve", "gpu-h100:7")
    assert r.returncode == 2 and "its GPUs: 0, 1" in r.stderr
    r = gputop("reserve", "gpu-h100")
    assert r.returncode == 2 and "HOST:GPU" in r.stderr
    r = gputop("reserve", "gpu-h100:0", "--for", "30d")
    assert r.returncode == 2 and "the longest reservation here, 7d" in r.stderr, r.stderr
    assert "7d0h" not in r.stderr and "release" not in r.stderr  # (no "give it back")
    assert not gputop.path.exists()


def test_messages_say_what_to_type(gputop: Any) -> None:
    r = gputop("reserve", "gpu-mixed:1", "--for", "0m")
    assert r.returncode == 2 and "--for 0m" in r.stderr and "--for 30m" in r.stderr
    assert "gputop release HOST:GPU" in r.stderr and "Traceback" not in r.stderr
    r = gputop("release")
    assert r.returncode == 2
    assert "gputop release HOST:GPU" in r.stderr and "gputop release --mine" in r.stderr
    assert "you hold no reservations" in r.stderr
    assert gputop("reserve", "gpu-mixed:1").returncode == 0
    r = gputop("release")
    assert r.returncode == 2 and "yours now: gpu-mixed:1" in r.stderr
    r = gputop("release", "gpu-mixed:1", "--mine")
    assert r.returncode == 2 and "not both" in r.stderr
    assert held(gputop) == [("gpu-mixed", 1, "gtalice")]


def test_reserving_your_own_again_says_extended_or_kept(gputop: Any) -> None:
    r = gputop("reserve", "gpu-mixed:1", "--for", "1h")
    assert r.returncode == 0 and r.stdout.startswith("reserved gpu-mixed:1 until "), r.stdout
    r = gputop("reserve", "gpu-mixed:1", "--for", "3h")
    assert r.returncode == 0
    assert r.stdout.startswith("extended your reservation of gpu-mixed:1 until ")
    assert "(was until " in r.stdout
    r = gputop("reserve", "gpu-mixed:1", "--for", "30m", "--note", "eval")
    assert r.returncode == 0
    assert r.stdout.startswith("kept your reservation of gpu-mixed:1 until ")
    assert "already lasts longer" in r.stdout and "note updated" in r.stdout
    (rec,) = json.loads(gputop.path.read_text())["reservations"]
    left = datetime.fromisoformat(rec["expires"].replace("Z", "+00:00")) - utcnow()
    assert timedelta(hours=2, minutes=55) < left <= timedelta(hours=3)
    assert rec["note"] == "eval"


def test_extend_gives_your_own_more_time_and_takes_nothing_new(gputop: Any) -> None:
    """What an "ends in 15 min" notice says to run: more time for what you hold, the note
    kept; a GPU you do not hold (free, or someone else's) is never reserved by it."""
    r = gputop("reserve", "gpu-mixed:1", "--for", "30m", "--note", "eval")
    assert r.returncode == 0, r.stderr
    r = gputop("extend", "gpu-mixed:1", "--for", "2h")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("extended your reservation of gpu-mixed:1 until "), r.stdout
    (rec,) = json.loads(gputop.path.read_text())["reservations"]
    assert rec["note"] == "eval"
    r = gputop("extend", "gpu-mixed:2", "--for", "2h")  # free: not yours
    assert r.returncode == 2 and "not yours now" in r.stderr, r.stderr
    r = gputop("extend", "gpu-mixed:1", "--for", "2h", user="gtbob")  # gtalice's
    assert r.returncode == 2 and "not yours now" in r.stderr, r.stderr
    assert len(json.loads(gputop.path.read_text())["reservations"]) == 1


def test_human_output_is_local_time_and_json_utc(gputop: Any) -> None:
    tz = {"TZ": "XYZ-5:30"}  # POSIX TZ: UTC+5:30, named XYZ (no tzdata needed)
    r = gputop("reserve", "gpu-mixed:1", "--for", "2h", **tz)
    assert r.returncode == 0, r.stderr
    (rec,) = json.loads(gputop.path.read_text())["reservations"]
    assert rec["expires"].endswith("Z")
    expires = datetime.fromisoformat(rec["expires"].replace("Z", "+00:00"))
    local = (expires + timedelta(hours=5, minutes=30)).strftime("%Y-%m-%d %H:%M")
    assert f"until {local} XYZ (" in r.stdout, r.stdout
    listed = gputop("reservations", **tz).stdout
    assert f"{local} XYZ" in listed and rec["expires"] not in listed
    clash = gputop("reserve", "gpu-mixed:1", user="gtbob", **tz)
    assert clash.returncode == 1 and f"until {local} XYZ" in clash.stderr
    doc = json.loads(gputop("reservations", "--json", **tz).stdout)
    assert doc["reservations"][0]["expires"] == rec["expires"]


def test_release_and_force(gputop: Any) -> None:
    assert gputop("reserve", "gpu-mixed:0").returncode == 0
    r = gputop("release", "gpu-mixed:0", user="gtbob")
    assert r.returncode == 1 and "--force" in r.stderr
    r = gputop("release", "gpu-mixed:0", "--force", user="gtbob")
    assert r.returncode == 0 and "held by gtalice" in r.stdout
    events = json.loads(gputop.path.read_text())["events"]
    assert events[-1]["by"] == "gtbob" and events[-1]["reservation"]["user"] == "gtalice"
    assert gputop("reserve", "gpu-mixed:0", "gpu-mixed:1").returncode == 0
    r = gputop("release", "--mine")
    assert r.returncode == 0 and r.stdout.count("released") == 2
    assert json.loads(gputop("reservations", "--json").stdout)["reservations"] == []


def test_identity_is_the_real_user_not_the_environment(gputop: Any) -> None:
    """gtbob claiming to be gtalice through $LOGNAME/$USER gets nothing of hers."""
    assert gputop("reserve", "gpu-mixed:0", "--note", "alice's").returncode == 0
    posing = {"LOGNAME": "gtalice", "USER": "gtalice"}
    r = gputop("release", "gpu-mixed:0", user="gtbob", **posing)
    assert r.returncode == 1 and "--force" in r.stderr and "gtalice" in r.stderr
    r = gputop("release", "--mine", user="gtbob", **posing)
    assert r.returncode == 0 and "nothing to release" in r.stderr
    r = gputop("reserve", "gpu-mixed:0", "--for", "7d", user="gtbob", **posing)
    assert r.returncode == 1  # not "extended": it is not his
    assert gputop("reserve", "gpu-mixed:1", user="gtbob", **posing).returncode == 0
    assert held(gputop) == [("gpu-mixed", 0, "gtalice"), ("gpu-mixed", 1, "gtbob")]
    r = gputop("release", "gpu-mixed:0", "--force", user="gtbob", **posing)
    assert r.returncode == 0 and "held by gtalice" in r.stdout
    (event,) = json.loads(gputop.path.read_text())["events"]
    assert event["by"] == "gtbob" and event["reservation"]["note"] == "alice's"


def test_whoami_ignores_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from gputop.reservations.ops import whoami

    for var in ("USER", "LOGNAME", "LNAME", "USERNAME"):
        monkeypatch.setenv(var, "mallory")
    assert whoami()[0] == pwd.getpwuid(os.getuid()).pw_name


def test_free_lists_and_reserves_idle_unreserved(gputop: Any) -> None:
    # Of the fleet's GPUs only gpu-mixed:2 (RTX 2080 SUPER, idle, 211 MiB) is free: the rest
    # run processes, hold memory, show load, or are lost (--whole: gpu-mixed:0's idle MIG
    # instances are free too; tests/test_mig_fleet.py lists them).
    r = gputop("free", "--whole")
    assert r.returncode == 0 and r.stdout == "gpu-mixed:2\n"
    r = gputop("free", "--whole", "--count", "2")
    assert r.returncode == 1 and "1 free" in r.stderr
    r = gputop("free", "--whole", "--min-free-memory", "20G")
    assert r.returncode == 1
    r = gputop("free", "--whole", "--reserve", "--for", "1h", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["reserved"] and [(f["host"], f["gpu"]) for f in doc["free"]] == [("gpu-mixed", 2)]
    (rec,) = json.loads(gputop.path.read_text())["reservations"]
    assert doc["free"][0]["expires"] == rec["expires"]
    assert re.search(r"^reserved gpu-mixed:2 until \S+ \S+ UTC \(", r.stderr, re.M), r.stderr
    r = gputop("free", "--whole", user="gtbob")
    assert r.returncode == 1, r.stderr  # now reserved by gtalice
    r = gputop("free", "--whole", "--reserve", "--for", "2h")  # still free to its holder: extended
    assert r.returncode == 0 and r.stdout == "gpu-mixed:2\n"
    assert "extended your reservation of gpu-mixed:2 until" in r.stderr


def test_snapshot_carries_reservations_and_flags(gputop: Any, schema: Any) -> None:
    # gtbob's job runs on gpu-h100:1; gpu-mixed:2 runs nothing.
    assert gputop("reserve", "gpu-h100:1", "gpu-mixed:2").returncode == 0
    r = gputop("--json", user="gtbob")  # a teammate sees it at the next refresh
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, schema)
    by = {h["name"]: h for h in doc["hosts"]}
    g1 = by["gpu-h100"]["gpus"][1]
    assert g1["reservation"]["user"] == "gtalice"
    assert "unreserved-use" in g1["flags"]  # gtbob's job runs on gtalice's GPU
    idle = by["gpu-mixed"]["gpus"][2]
    assert idle["reservation"]["user"] == "gtalice"
    assert idle["flags"] == []  # just reserved: within the grace period
    assert by["gpu-h100"]["gpus"][0]["reservation"] is None
    assert by["gpu-lost"]["gpus"][1]["flags"] == ["lost"]
    # Made an hour ago and never used: now it is an idle reservation.
    only(gputop, "gpu-h100", "gpu-mixed")
    d = json.loads(gputop.path.read_text())
    for rec in d["reservations"]:
        rec["created"] = iso(utcnow() - timedelta(hours=1))
    gputop.path.write_text(json.dumps(d))
    doc = json.loads(gputop("--json", user="gtbob").stdout)
    by = {h["name"]: h for h in doc["hosts"]}
    assert by["gpu-mixed"]["gpus"][2]["flags"] == ["idle-reservation"]
    assert by["gpu-h100"]["gpus"][1]["flags"] == ["unreserved-use", "idle-reservation"]


def test_idle_grace_is_configurable(gputop: Any) -> None:
    only(gputop, "gpu-mixed")
    cfg = gputop.config
    text = cfg.read_text().replace("[reservations]\n", '[reservations]\nidle_grace = "bad"\n')
    cfg.write_text(text)
    r = gputop("--json")
    assert r.returncode == 2 and "reservations.idle_grace" in r.stderr
    cfg.write_text(text.replace('"bad"', '"2h"'))
    assert gputop("reserve", "gpu-mixed:2").returncode == 0
    d = json.loads(gputop.path.read_text())
    d["reservations"][0]["created"] = iso(utcnow() - timedelta(hours=1))
    gputop.path.write_text(json.dumps(d))
    doc = json.loads(gputop("--json").stdout)
    mixed = next(h for h in doc["hosts"] if h["name"] == "gpu-mixed")
    assert mixed["gpus"][2]["flags"] == []  # 1 h unused < 2 h grace


def test_broken_store_does_not_stop_the_snapshot(gputop: Any, schema: Any) -> None:
    gputop.path.write_text("{oops")
    r = gputop("--json")
    assert r.returncode == 0
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, schema)
    assert "not valid JSON" in doc["reservations_error"] and "not valid JSON" in r.stderr
    assert gputop.path.read_text() == "{oops"


HOSTILE_FILES = {
    "deep-nesting": '{"version": 1, "reservations": ' + "[" * 50_000 + "]" * 50_000 + "}",
    "time-out-of-range": json.dumps({"version": 1, "reservations": [{
        "id": "a", "host": "gpu-mixed", "gpu": 0, "user": "u", "machine": "m",
        "created": "0001-01-01T00:00:00+01:00", "expires": "9999-12-31T23:59:59-01:00"}]}),
    "gpu-5000-digits": '{"version": 1, "reservations": [{"gpu": ' + "7" * 5000 + "}]}",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_FILES))
def test_hostile_store_json_reports_and_goes_on(gputop: Any, schema: Any, kind: str) -> None:
    only(gputop, "gpu-mixed")
    gputop.path.write_text(HOSTILE_FILES[kind])
    r = gputop("--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, schema)
    assert str(gputop.path) in doc["reservations_error"] and "Traceback" not in r.stderr
    for args in (["reservations"], ["reserve", "gpu-mixed:2"], ["release", "--mine"]):
        r = gputop(*args)
        assert r.returncode == 2 and str(gputop.path) in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr
    assert gputop.path.read_text() == HOSTILE_FILES[kind]


def test_times_in_messages_are_not_utc_when_local_is_not(gputop: Any) -> None:
    now = datetime.now(timezone.utc)
    assert gputop("reserve", "gpu-mixed:1", "--for", "1h", TZ="XYZ+3").returncode == 0
    listed = gputop("reservations", TZ="XYZ+3").stdout
    assert (now + timedelta(hours=-3 + 1)).strftime("%Y-%m-%d") in listed and "XYZ" in listed


def test_one_look_commands_query_once_and_start_no_loop(gputop: Any, fleet: Fleet) -> None:
    """`free` and `reserve` look once: one query per host (as `--json`), never the
    streaming loops, whose first samples they would otherwise wait for."""
    only(gputop, "gpu-h100")
    host = fleet.hosts["gpu-h100"]
    before = len(fleet.calls(host))
    assert gputop("free", "--whole").returncode in (0, 1)
    r = gputop("reserve", "gpu-h100:1", "--for", "1m")
    assert r.returncode == 0, r.stderr
    calls = fleet.calls(host)[before:]
    assert calls and not any("-lms" in c or "--loop" in c for c in calls), calls
    assert sum("--query-gpu" in c for c in calls) == 2, calls  # one query per command


def test_a_host_that_does_not_answer_takes_only_gpus_it_is_known_to_have(
        gputop: Any) -> None:
    """Hosts where nothing listens: one never seen, one with ``gpus = N`` in hosts.toml,
    one in the history database. Only GPUs known to exist are reserved there, and one
    teammate's flood of 256 GPUs is refused by their budget while the other reserves."""
    only(gputop, "gpu-h100")
    team = gputop.path.parent
    hist = team / "history.sqlite3"
    rec = Recorder(HistoryDB(hist, writer=True), interval=10.0)
    rec.record(HostSnapshot("gpu-rec", gpus=tuple(
        GpuInfo(index=i, uuid=f"GPU-rec-{i}", name="H100") for i in range(2))))
    rec.flush()
    rec.db.close()
    down = 'address = "127.0.0.1"\nport = 1\n'
    with gputop.config.open("a") as f:
        f.write(f'[[hosts]]\nname = "gpu-gone"\n{down}\n[[hosts]]\nname = "gpu-said"\n{down}'
                f'gpus = 2\n\n[[hosts]]\nname = "gpu-rec"\n{down}\n[[hosts]]\n'
                f'name = "gpu-big"\n{down}gpus = 256\n\n[history]\npath = "{hist}"\n')
    r = gputop("reserve", "gpu-gone:0")
    assert r.returncode == 2 and "never seen its GPUs" in r.stderr, r.stderr
    assert "gpus = N" in r.stderr
    r = gputop("reserve", "gpu-said:0,1")
    assert r.returncode == 0 and "could not check gpu-said:1" in r.stderr, r.stderr
    r = gputop("reserve", "gpu-said:2", user="gtbob")
    assert r.returncode == 2 and "no GPU 2" in r.stderr and "gpus = 2 in" in r.stderr
    r = gputop("reserve", "gpu-rec:1", user="gtbob")
    assert r.returncode == 0, r.stderr
    r = gputop("reserve", "gpu-rec:2", user="gtbob")
    assert r.returncode == 2 and f"the history in {hist}: 0, 1" in r.stderr, r.stderr
    r = gputop("reserve", "gpu-rec:0/3", user="gtbob")
    assert r.returncode == 2 and "no MIG instance 3" in r.stderr, r.stderr
    before = gputop.path.read_bytes()
    r = gputop("reserve", "gpu-big:" + ",".join(map(str, range(256))), "--for", "7d",
               "--note", "x" * 500, user="gtbob")
    assert r.returncode == 2 and "gtbob would hold 257" in r.stderr, r.stderr
    assert "at most 64" in r.stderr and "Traceback" not in r.stderr
    assert gputop.path.read_bytes() == before
    assert gputop("reserve", "gpu-big:255", "--for", "7d").returncode == 0
    assert sorted(held(gputop)) == [("gpu-big", 255, "gtalice"), ("gpu-rec", 1, "gtbob"),
                                    ("gpu-said", 0, "gtalice"), ("gpu-said", 1, "gtalice")]


def test_your_live_reservation_on_a_host_that_does_not_answer_can_be_extended(
        gputop: Any) -> None:
    """A host gputop has never seen (no history, no ``gpus = N``) that does not answer:
    its holder may extend a live reservation there, and the GPU it names is known to them
    only; a teammate cannot use that entry (nor a forged one in their name elsewhere) to
    reserve a GPU gputop does not know."""
    only(gputop, "gpu-h100")
    with gputop.config.open("a") as f:
        f.write('[[hosts]]\nname = "gpu-gone"\naddress = "127.0.0.1"\nport = 1\n')

    def plant(state: StoreState, now: datetime) -> StoreState:
        return replace(state, reservations=(
            new_reservation(Target("gpu-gone", 0), Terms(600, user="gtalice", machine="m"),
                            now),
            new_reservation(Target("gpu-gone", 1), Terms(60, user="gtbob", machine="m"),
                            now - timedelta(hours=2))))  # gtbob's, ended
    Store(gputop.path).update(plant)
    gputop.path.chmod(0o664)
    before = {r.id: r.expires for r in Store(gputop.path).read().reservations}
    r = gputop("reserve", "gpu-gone:0", "--for", "1h")
    assert r.returncode == 0, r.stderr
    assert "your live reservation" in r.stderr, r.stderr
    now = {(r.host, r.gpu, r.user): r for r in Store(gputop.path).read().reservations}
    mine = now[("gpu-gone", 0, "gtalice")]
    assert mine.expires > before[mine.id] + timedelta(minutes=30)  # extended, not a new one
    r = gputop("reserve", "gpu-gone:1")  # another GPU there: still unknown
    assert r.returncode == 2 and "no GPU 1" in r.stderr, r.stderr
    r = gputop("reserve", "gpu-gone:0", user="gtbob")  # someone else's entry proves nothing
    assert r.returncode == 2 and "never seen its GPUs" in r.stderr, r.stderr
    r = gputop("reserve", "gpu-gone:1", user="gtbob")  # nor their own ended one
    assert r.returncode == 2 and "never seen its GPUs" in r.stderr, r.stderr
    assert held(gputop) == [("gpu-gone", 0, "gtalice")]


def test_a_count_past_the_budget_is_refused_before_it_queues(gputop: Any) -> None:
    """A waiter for more GPUs than one user may hold could never be granted (its claim
    would be refused): refused at once, before it queues; a count to look at is fine."""
    only(gputop, "gpu-h100")
    for args in (("free", "--count", "65", "--wait"), ("free", "--count", "65", "--reserve"),
                 ("run", "--count", "65", "--", "true")):
        r = gputop(*args)
        assert r.returncode == 2 and "--count 65: more than the 64 GPUs" in r.stderr, r.stderr
    assert not gputop.path.exists() or "queue" not in json.loads(gputop.path.read_text())
    r = gputop("free", "--count", "65")
    assert r.returncode == 1 and "65 wanted" in r.stderr, r.stderr
