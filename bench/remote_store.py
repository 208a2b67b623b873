"""The reservations file over SSH (``HOST:/path``), measured on the real-sshd test fleet.

    python -m bench.remote_store                       # 50 latency trials, 4 x 100, 50 kills
    python -m bench.remote_store --trials 10 --writes 20 --kills 10   # quick

Needs root (it creates the SSH login users of tests/support/fleet.py) and flock(1).

1. Latency: one reservation (reserve + release, two writes) through a local Store and
   through a RemoteStore to the fleet's store host, alternating; and a read of an
   unchanged file (local: stat + read; remote: one cksum round trip, no body).
2. 4 users x N concurrent writes over SSH: four processes, each logged in as its own user
   of the team group, each reserving N distinct GPUs one write at a time; lost = expected
   reservations missing from the file at the end.
3. ``--kills`` times: a process writing over SSH as fast as it can (reserve, release, ...)
   is ``kill -9``ed at a random moment; then the file must decode, a local writer must get
   the lock within 10 s (the script's watchdog would take 30 s: the lock died with the
   session), and no writer script may be left running on the host.

Writes ``bench/results/remote-store.md`` and ``remote-store.json``.
"""

from __future__ import annotations

import argparse
import grp
import json
import os
import platform
import pwd
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gputop.config.load import load_config
from gputop.reservations.filelock import StoreError
from gputop.reservations.open import open_store
from gputop.reservations.ops import Target, release, reserve
from gputop.reservations.remote import RemoteStore
from gputop.reservations.store import Store
from tests.support.fleet import (
    LOGIN_USERS,
    TEAM_GROUP,
    Fleet,
    Host,
    ensure_login_users,
    is_root,
    sshd_available,
)

ROOT = Path(__file__).resolve().parents[1]

OUT = ROOT / "bench" / "results"

WRITER = r"""
import sys
from gputop.config.load import load_config
from gputop.reservations.ops import Target, reserve
from gputop.reservations.open import open_store
st = open_store(load_config(sys.argv[1]))
base, n = int(sys.argv[2]), int(sys.argv[3])
st.whoami()
print("ready", flush=True)
sys.stdin.readline()  # all start together
for k in range(n):
    reserve(st, [Target("gpu", base + k)], seconds=3600, max_seconds=7200)
"""

BUSY = r"""
import sys
from gputop.config.load import load_config
from gputop.reservations.ops import Target, release, reserve
from gputop.reservations.open import open_store
st = open_store(load_config(sys.argv[1]))
st.whoami()
print("ready", flush=True)
while True:
    reserve(st, [Target("gpu", 9)], seconds=600, max_seconds=7200)
    release(st, [Target("gpu", 9)])
"""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def ms(x: float) -> str:
    return f"{x * 1000:.1f} ms"


def writer_scripts(user: str) -> list[int]:
    uid = pwd.getpwnam(user).pw_uid
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and d.stat().st_uid == uid and \
                    b"flock -x" in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except OSError:
            continue
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--writes", type=int, default=100)
    ap.add_argument("--kills", type=int, default=50)
    args = ap.parse_args()
    if sshd_available() or not is_root() or shutil.which("flock") is None:
        print("needs sshd, root and flock(1)", file=sys.stderr)
        return 2
    users = ensure_login_users()
    assert len(users) == len(LOGIN_USERS), users
    root = Path(tempfile.mkdtemp(prefix="gputop-bench-remote-", dir="/tmp"))
    root.chmod(0o755)
    fleet = Fleet(root, [Host("store", "127.0.23.2")]).start()
    results: dict[str, Any] = {"args": vars(args)}
    try:
        h = fleet.hosts["store"]
        with (fleet.ssh / "config").open("a") as f:
            for u in users:
                f.write(f"\nHost store-as-{u}\n  HostName {h.address}\n  Port {h.port}\n"
                        f"  User {u}\n  IdentityFile {fleet.ssh / 'id_ed25519'}\n"
                        f"  IdentitiesOnly yes\n"
                        f"  UserKnownHostsFile {fleet.ssh / 'known_hosts'}\n")
        os.environ["HOME"] = str(fleet.home)
        os.environ.pop("SSH_AUTH_SOCK", None)
        team = root / "team"
        team.mkdir()
        os.chown(team, 0, grp.getgrnam(TEAM_GROUP).gr_gid)
        team.chmod(0o2775)
        path = team / "reservations.json"

        def cfg(user: str) -> Path:
            c = root / f"hosts-{user}.toml"
            c.write_text(f'[defaults]\ntimeout = 10\n[reservations]\npath = '
                         f'"store-as-{user}:{path}"\n[[hosts]]\nname = "gpu"\n')
            return c

        env = fleet.env()
        env["PYTHONPATH"] = str(ROOT)

        # 1. latency ---------------------------------------------------------------------
        local = Store(path)
        remote = open_store(load_config(str(cfg(users[0]))))
        assert isinstance(remote, RemoteStore)
        remote.whoami()  # connected: the kept connection is what a board or command reuses
        lat: dict[str, list[float]] = {"local": [], "remote": [], "local-read": [],
                                       "remote-read": []}
        for i in range(args.trials):
            for kind, st in (("local", local), ("remote", remote)) if i % 2 else \
                    (("remote", remote), ("local", local)):
                t0 = time.perf_counter()
                reserve(st, [Target("gpu", 1)], seconds=600, max_seconds=7200)  # type: ignore[arg-type]
                release(st, [Target("gpu", 1)])  # type: ignore[arg-type]
                lat[kind].append(time.perf_counter() - t0)
                st.read()
                t0 = time.perf_counter()
                st.read()  # unchanged since the last read
                lat[kind + "-read"].append(time.perf_counter() - t0)
        results["latency"] = {k: {"median": statistics.median(v), "p90": pct(v, 0.9),
                                  "max": max(v), "n": len(v)} for k, v in lat.items()}
        fetched = remote.fetches
        for _ in range(20):
            remote.read()
        results["unchanged_reads_fetched"] = remote.fetches - fetched

        # 2. 4 users x N concurrent writes ------------------------------------------------
        path.unlink()
        procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(cfg(u)), str(i * 10000),
                                   str(args.writes)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, env=env)
                 for i, u in enumerate(users)]
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        t0 = time.perf_counter()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(b"go\n")
            p.stdin.close()
        codes = [p.wait(1800) for p in procs]
        took = time.perf_counter() - t0
        state = Store(path).read()
        want = {("gpu", i * 10000 + k, u) for i, u in enumerate(users)
                for k in range(args.writes)}
        got = {(r.host, r.gpu, r.user) for r in state.reservations}
        results["concurrent"] = {"users": len(users), "writes_each": args.writes,
                                 "exit_codes": codes, "seconds": took,
                                 "expected": len(want), "present": len(want & got),
                                 "lost": len(want - got), "unexpected": len(got - want)}

        # 3. kill -9 of a busy writer at random moments ------------------------------------
        path.unlink()
        kills: list[dict[str, Any]] = []
        rng = random.Random(22)
        for _ in range(args.kills):
            p = subprocess.Popen([sys.executable, "-c", BUSY, str(cfg(users[1]))],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
            assert p.stdout is not None and p.stdout.readline() == b"ready\n"
            time.sleep(rng.uniform(0.0, 0.6))  # a random moment of its write loop
            p.kill()
            p.wait(10)
            broken = None
            held = False
            try:
                held = bool(Store(path).read().reservations)
            except StoreError as exc:
                broken = str(exc)
            t0 = time.perf_counter()
            try:
                Store(path).update(lambda s, now: s, timeout=10)
                lock_s: float | None = time.perf_counter() - t0
            except StoreError:
                lock_s = None
            deadline = time.monotonic() + 10
            while writer_scripts(users[1]) and time.monotonic() < deadline:
                time.sleep(0.05)
            temps = [x.name for x in team.iterdir() if ".tmp." in x.name]
            kills.append({"broken": broken, "held": held, "lock_free_after_s": lock_s,
                          "scripts_left": len(writer_scripts(users[1])), "temps_left": temps})
        results["kills"] = {
            "n": len(kills),
            "broken_files": sum(k["broken"] is not None for k in kills),
            "killed_while_reserved": sum(k["held"] for k in kills),
            "lock_not_free_in_10s": sum(k["lock_free_after_s"] is None for k in kills),
            "lock_wait_max_s": max((k["lock_free_after_s"] or 0) for k in kills),
            "scripts_left": sum(k["scripts_left"] for k in kills),
            "temps_left_after_next_write": sum(len(k["temps_left"]) for k in kills),
        }
        remote.close()
    finally:
        fleet.stop()
        shutil.rmtree(root, ignore_errors=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "remote-store.json").write_text(json.dumps(results, indent=1) + "\n")
    write_md(results)
    print((OUT / "remote-store.md").read_text())
    return 0


def write_md(r: dict[str, Any]) -> None:
    lat, c, k = r["latency"], r["concurrent"], r["kills"]
    a = r["args"]
    lines = [
        "# Reservations over SSH (`HOST:/path`)",
        "",
        f"Run: `python -m bench.remote_store --trials {a['trials']} --writes {a['writes']} "
        f"--kills {a['kills']}` on {os.cpu_count()} cores, {platform.platform()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. The store host is a real "
        "sshd on loopback (no network latency: over a LAN or VPN add its round trips, "
        "about 4 per write and 1 per unchanged read); other work shared the machine.",
        "",
        "## Latency, side by side (alternating)",
        "",
        "| what | local Store | RemoteStore over SSH |",
        "|---|---|---|",
        f"| one reservation: reserve + release (two locked writes), median | "
        f"{ms(lat['local']['median'])} | {ms(lat['remote']['median'])} |",
        f"| same, p90 / max | {ms(lat['local']['p90'])} / {ms(lat['local']['max'])} | "
        f"{ms(lat['remote']['p90'])} / {ms(lat['remote']['max'])} |",
        f"| a read of an unchanged file, median | {ms(lat['local-read']['median'])} | "
        f"{ms(lat['remote-read']['median'])} |",
        "",
        f"An unchanged file is not fetched again: 20 reads after the last change fetched "
        f"the body {r['unchanged_reads_fetched']} times (one `cksum` line each way).",
        "",
        f"## {c['users']} users x {c['writes_each']} concurrent writes over SSH",
        "",
        f"{c['users']} processes, each logged in as its own user of the team group, "
        f"reserving {c['writes_each']} distinct GPUs one write at a time, all started "
        f"together: {c['seconds']:.1f} s; exit codes {c['exit_codes']}; expected "
        f"{c['expected']} reservations, present {c['present']}, **lost {c['lost']}** "
        f"(unexpected {c['unexpected']}).",
        "",
        f"## {k['n']} `kill -9` of a writer at a random moment",
        "",
        "A process reserving and releasing over SSH as fast as it can, killed after a "
        "random 0-0.6 s of its loop (connecting, waiting for the lock, holding it, sending, "
        "committed):",
        "",
        f"- broken files: **{k['broken_files']}**",
        f"- where the kill landed: {k['killed_while_reserved']} between its reserve and its "
        f"release (the file holds the reservation), {k['n'] - k['killed_while_reserved']} "
        "elsewhere (the kill-at-each-step cases are in tests/test_remote_store.py)",
        f"- lock still held 10 s later: **{k['lock_not_free_in_10s']}** (longest wait for "
        f"it: {k['lock_wait_max_s']:.2f} s; the script's watchdog would take 30 s)",
        f"- writer scripts left running on the host: {k['scripts_left']}",
        f"- temp files left after the next write: {k['temps_left_after_next_write']}",
        "",
    ]
    (OUT / "remote-store.md").write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
