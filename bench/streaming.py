"""Streaming collection against one query per refresh, side by side on one fleet.

    python -m bench.streaming                 # 50 hosts, 30 s per mode, 5 s slow start
    python -m bench.streaming --hosts 10 --steady 10 --slow-steady 10   # quicker
    python -m bench.streaming --old c38dcab   # also the streams of that commit (3 sessions)

Brings up N real OpenSSH sshd hosts (``tests/support/fleet.py``; 4 GPUs and one job of a real
user each; stand-in nvidia-smi with ``--latency`` start-up) and runs ``gputop --json
--watch`` at a 2 s interval with ``collection = "query"`` and then ``"stream"``, measuring
in the steady state (from the first complete document on):

- host-side CPU per host per refresh: utime + stime (+ the reaped children's) summed over
  every process under each host's sshd, i.e. everything sshd runs for gputop;
- process starts per host per refresh: nvidia-smi and ps starts, from the stand-ins' logs;
- client CPU per refresh (the gputop process), and refresh-to-refresh times;
- slow nvidia-smi: the same with a ``--slow`` s start-up on every host: how old the data
  gets (the time between documents with every host fresh) against the 2 s interval.

Writes ``bench/results/streaming.md`` and ``streaming.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from tests.support.fleet import Fleet, GpuProcess, Host, sshd_available

ROOT = Path(__file__).resolve().parents[1]

PY = sys.executable
OUT = ROOT / "bench" / "results"
TICK = os.sysconf("SC_CLK_TCK")


def address(i: int) -> str:
    return f"127.0.{40 + i // 250}.{1 + i % 250}"


def up(n: int, latency: float, root: Path) -> Fleet:
    hosts = [Host(f"s{i:03d}", address(i), gpus=("h100", "h100", "l40s", "rtx2080"),
                  delay=latency, processes=[GpuProcess("gtalice", f"python job{i}.py")])
             for i in range(n)]
    fleet = Fleet(root, hosts).start()
    return fleet


def host_cpu(fleet: Fleet) -> float:
    """CPU seconds of everything under every host's sshd (live processes, and what their
    reaped children used)."""
    stats: dict[int, tuple[int, float]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ppid = int(f[1])
        cpu = sum(int(x) for x in f[11:15]) / TICK  # utime stime cutime cstime
        stats[int(d.name)] = (ppid, cpu)
    roots = {h.proc.pid for h in fleet.hosts.values() if h.proc is not None}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, list(roots)
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo.extend(children.get(pid, []))
    return total


def starts(fleet: Fleet) -> int:
    return sum(len(fleet.calls(h)) for h in fleet.hosts.values())


def calls_since(fleet: Fleet, before: dict[str, int]) -> list[str]:
    """The processes each host started since ``before`` (its call counts then)."""
    return [f"{name}: {c}" for name, h in fleet.hosts.items()
            for c in fleet.calls(h)[before.get(name, 0):]]


def _cpu(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TICK


def watch(fleet: Fleet, collection: str, seconds: float, interval: float = 2.0,
          first_timeout: float = 60.0, code: Path | None = None) -> dict[str, object]:
    """``gputop --json --watch`` until ``seconds`` into the steady state; ``code``: run the
    gputop package found there instead (an older commit's, for comparison)."""
    cfg = fleet.write_config(timeout=10.0, interval=interval, first_sample_timeout=first_timeout,
                             extra=f'collection = "{collection}"')
    env = fleet.env()
    if code is not None:
        env["PYTHONPATH"] = str(code)
    proc = subprocess.Popen([PY, "-m", "gputop", "--json", "--watch", "--config", str(cfg)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, cwd=str(code) if code is not None else None)
    assert proc.stdout is not None
    launched = time.monotonic()
    arrivals: list[float] = []
    ages: list[float] = []
    complete: list[bool] = []
    cold = None
    c0 = h0 = 0.0
    s0 = 0
    counts: dict[str, int] = {}
    deadline = None
    while True:
        line = proc.stdout.readline()
        if not line:
            break
        now = time.monotonic()
        doc = json.loads(line)
        ok = all(h["status"] == "ok" for h in doc["hosts"])
        if deadline is None:
            if not ok:
                continue  # starting: not yet the steady state
            cold = now - launched
            c0, h0, s0, deadline = _cpu(proc.pid), host_cpu(fleet), starts(fleet), now + seconds
            counts = {name: len(fleet.calls(h)) for name, h in fleet.hosts.items()}
        arrivals.append(now)
        # How old the oldest host's data is: each host's ``time`` is when its last answer
        # came (whole seconds, so this is an upper bound: up to 1 s too old).
        wall = time.time()
        ages.append(max(wall - datetime.fromisoformat(h["time"].replace("Z", "+00:00"))
                        .timestamp() for h in doc["hosts"]))
        complete.append(ok)
        if now >= deadline:
            break
    cpu = _cpu(proc.pid) - c0
    hcpu = host_cpu(fleet) - h0
    started = starts(fleet) - s0
    steady_calls = calls_since(fleet, counts)
    proc.terminate()
    proc.wait(10)
    time.sleep(1.0)  # the streams end with their channels
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    refreshes = len(gaps)
    n = len(fleet.hosts)
    return {"collection": collection, "hosts": n, "refreshes": refreshes,
            "first_complete_s": cold,
            "gap_median_s": statistics.median(gaps), "gap_max_s": max(gaps),
            "age_median_s": statistics.median(ages), "age_max_s": max(ages),
            "all_complete": all(complete),
            "host_cpu_ms_per_host_per_refresh": 1000 * hcpu / n / refreshes,
            "process_starts_per_host_per_refresh": started / n / refreshes,
            "client_cpu_ms_per_refresh": 1000 * cpu / refreshes,
            "left_running": sum(len(fleet.remote_processes(h)) for h in fleet.hosts.values()),
            "steady_calls": steady_calls[:4]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hosts", type=int, default=50)
    ap.add_argument("--steady", type=float, default=30.0)
    ap.add_argument("--latency", type=float, default=0.15)
    ap.add_argument("--slow", type=float, default=5.0)
    ap.add_argument("--slow-steady", type=float, default=20.0)
    ap.add_argument("--old", metavar="REV",
                    help="also run the streaming collection of this git commit (steady state)")
    args = ap.parse_args()
    reason = sshd_available()
    if reason:
        print(f"bench: {reason}", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="gputop-bench-stream-"))
    os.chmod(root, 0o755)
    results: dict[str, object] = {"hosts": args.hosts, "latency_s": args.latency,
                                  "slow_s": args.slow, "cores": os.cpu_count(),
                                  "load": " ".join(Path("/proc/loadavg").read_text().split()[:3])}
    old: Path | None = None
    if args.old:
        old = root / "old"
        old.mkdir()
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.old],
                             capture_output=True, text=True, check=True).stdout.strip()
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "gputop"],
                             capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=tar, check=True)
        results["old_rev"] = rev
    fleet = up(args.hosts, args.latency, root)
    try:
        for mode in ("query", "stream", "old-stream"):
            if mode == "old-stream" and old is None:
                continue
            r = watch(fleet, mode.removeprefix("old-"), args.steady,
                      code=old if mode.startswith("old-") else None)
            results[mode] = r
            print(r, flush=True)
        for h in fleet.hosts.values():
            fleet.set_scenario(h, "ok", delay=args.slow)
        for mode in ("query", "stream"):
            r = watch(fleet, mode, args.slow_steady)
            results[f"slow-{mode}"] = r
            print(r, flush=True)
    finally:
        fleet.stop()
        shutil.rmtree(root, ignore_errors=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "streaming.json").write_text(json.dumps(results, indent=1) + "\n")
    (OUT / "streaming.md").write_text(report(results))
    print((OUT / "streaming.md").read_text())
    return 0


def report(r: dict) -> str:  # type: ignore[type-arg]
    q, s = r["query"], r["stream"]
    sq, ss = r["slow-query"], r["slow-stream"]
    # /proc counts CPU in clock ticks: a stream total of 0 means under one tick.
    tick_ms = 1000 / TICK / r["hosts"] / s["refreshes"]
    lower = max(s["host_cpu_ms_per_host_per_refresh"], tick_ms)
    ratio = q["host_cpu_ms_per_host_per_refresh"] / lower
    at_least = "" if s["host_cpu_ms_per_host_per_refresh"] >= tick_ms else "at least "
    rows = []
    runs = [("query per refresh", q)]
    if "old-stream" in r:
        runs.append((f"streams, 3 sessions per host ({r['old_rev']})", r["old-stream"]))
    runs.append(("streams, 1 session per host (now)", s))
    for label, x in runs:
        rows.append(f"| {label} | {x['host_cpu_ms_per_host_per_refresh']:.2f} ms | "
                    f"{x['process_starts_per_host_per_refresh']:.2f} | "
                    f"{x['client_cpu_ms_per_refresh']:.0f} ms | {x['first_complete_s']:.1f} s | "
                    f"{x['gap_median_s']:.2f} / {x['gap_max_s']:.2f} s | {x['refreshes']} | "
                    f"{'yes' if x['all_complete'] else 'NO'} |")
    slow = []
    for label, x in (("query per refresh", sq), ("streams, 1 session per host (now)", ss)):
        slow.append(f"| {label} | {x['first_complete_s']:.1f} s | {x['age_median_s']:.1f} s | "
                    f"{x['age_max_s']:.1f} s | {x['age_max_s'] / 2.0:.2f} x | "
                    f"{x['process_starts_per_host_per_refresh']:.2f} | "
                    f"{'yes' if x['all_complete'] else 'NO'} |")
    return "\n".join([
        "# Streaming collection: what a refresh costs the monitored hosts\n",
        f"One run, one fleet: {r['hosts']} real OpenSSH sshd hosts on loopback (4 GPUs and one "
        f"job of a real user each), stand-in nvidia-smi starting in {r['latency_s'] * 1000:.0f}"
        f" ms, `gputop --json --watch` at a 2 s interval; {r['cores']} cores shared by the "
        "fleet, the client and other work, so compare the rows, not the absolute numbers "
        f"(load average before the run: {r.get('load', '?')}). "
        "Produced by `python -m bench.streaming`. No GPU machine was used: the stand-in "
        "nvidia-smi replays real captures and loops like the real one (`-lms`).\n",
        "## Steady state\n",
        "| collection | host CPU per host per refresh | process starts per host per refresh "
        "| client CPU per refresh | first complete document | refresh-to-refresh (median / "
        "max) | refreshes | every refresh complete |",
        "|---|---:|---:|---:|---:|---:|---:|:---:|",
        *rows,
        "",
        f"Host-side CPU: **{at_least}{ratio:.1f}x lower** streaming (target >= 5x). Host CPU is "
        "utime + stime of every process under each host's sshd, including what their reaped "
        "children used (the loop shell, nvidia-smi, ps, sshd's session process). Process "
        "starts are nvidia-smi and ps starts logged by the stand-ins (the per-refresh script "
        "also forks subshells, not counted).\n",
        f"## Slow nvidia-smi: {r['slow_s']:g} s start-up on every host\n",
        "| collection | first complete document | data age, oldest host per document: "
        "median | max | max / interval | process starts per host per refresh | every "
        "refresh complete |",
        "|---|---:|---:|---:|---:|---:|:---:|",
        *slow,
        "",
        "Data age: at each document, the time since the oldest host's last answer (its "
        "`time`, in whole seconds: an upper bound, up to 1 s more than the true age). "
        "`--watch` emits a document every interval with each host's latest data, so with a "
        "query per refresh the data shown is as old as the start-up time plus the wait for "
        "the next refresh; a host whose start-up exceeds `timeout` is a permanent `timeout`. "
        "Streaming pays the start-up once (the host shows `starting nvidia-smi: N s` "
        "meanwhile, and `first_sample_s` after), then delivers a sample every interval.\n",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
