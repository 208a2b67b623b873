"""gputop against what people do today, side by side, on one simulated fleet.

    python -m bench.run                      # N = 10, 50, 200; 60 s steady state; N = 500 scale
    python -m bench.run --sizes 10,50 --steady 20 --runs 3 --scale 0   # quicker

Brings up N real OpenSSH sshd hosts on loopback (the test fleet, ``tests/support/fleet.py``) whose
stand-in nvidia-smi takes ``--latency`` seconds per call (default 150 ms, like a real driver
with persistence mode on), then measures in the same run:

1. cold: time to a complete snapshot of every host: ``gputop --json`` vs the sequential
   ``for h in hosts; ssh h nvidia-smi ...; done`` loop vs ``parallel-ssh`` (Debian ``pssh``)
   running the same query; medians of ``--runs`` runs, reported as ratios;
2. steady state: ``gputop --json --watch`` for ``--steady`` seconds at a 2 s interval:
   refresh-to-refresh time, CPU seconds per refresh, peak RSS, SSH connections opened
   (counted in the sshd logs: must equal N);
3. the board: CPU per refresh of the Textual app, headless, 200 hosts x 8 GPUs;
4. scale: ``gputop --json`` at N = ``--scale`` must return every host healthy.

Writes ``bench/results/results.md``, ``results.json`` and ``results.png``. The machine's
cores are shared by the fleet's sshd processes and the tools: that bounds every tool alike,
which is why the targets are ratios from one run.
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
from pathlib import Path

from tests.support.fleet import GPU_ARGS, Fleet, Host, sshd_available

ROOT = Path(__file__).resolve().parents[1]

PY = sys.executable
OUT = ROOT / "bench" / "results"


def address(i: int) -> str:
    return f"127.0.{20 + i // 250}.{1 + i % 250}"


def up(n: int, latency: float, root: Path) -> Fleet:
    hosts = [Host(f"h{i:03d}", address(i), gpus=("h100", "h100", "l40s", "rtx2080"),
                  delay=latency) for i in range(n)]
    t = time.monotonic()
    fleet = Fleet(root, hosts).start()
    print(f"  fleet of {n} sshd hosts up in {time.monotonic() - t:.1f}s", flush=True)
    return fleet


def timed(cmd: list[str] | str, env: dict[str, str], shell: bool = False) -> tuple[float, str]:
    t = time.monotonic()
    r = subprocess.run(cmd, env=env, shell=shell, capture_output=True, text=True, timeout=900)
    return time.monotonic() - t, r.stdout


def connections(fleet: Fleet) -> int:
    total = 0
    for h in fleet.hosts.values():
        log = fleet.root / h.name / "sshd.log"
        if log.exists():
            total += log.read_text(errors="replace").count("Accepted publickey")
    return total


def cold(fleet: Fleet, runs: int, pssh: str | None) -> dict[str, object]:
    cfg = fleet.write_config(timeout=30.0)
    env = fleet.env()
    names = list(fleet.hosts)
    hostfile = fleet.root / "pssh-hosts"
    hostfile.write_text("\n".join(names) + "\n")
    remote = f"nvidia-smi {GPU_ARGS}"
    sshcfg = fleet.ssh / "config"
    loop = (f"for h in {' '.join(names)}; do ssh -F {sshcfg} -o BatchMode=yes $h {remote} "
            "|| echo FAILED $h; done")
    res: dict[str, list[float]] = {"gputop": [], "ssh-loop": [], "pssh": []}
    ok = {}
    for _ in range(runs):
        dt, out = timed([PY, "-m", "gputop", "--json", "--config", str(cfg)], env)
        res["gputop"].append(dt)
        doc = json.loads(out)
        ok["gputop"] = sum(h["status"] == "ok" for h in doc["hosts"])
        dt, out = timed(loop, env | {"SHELL": "/bin/sh"}, shell=True)
        res["ssh-loop"].append(dt)
        ok["ssh-loop"] = len(names) - out.count("FAILED")
        if pssh:
            # pssh's own default parallelism (32): more only makes it fail on 2 cores.
            dt, out = timed([pssh, "-h", str(hostfile), "-t", "120",
                             "-x", f"-F {sshcfg}", "-O", "BatchMode=yes", remote], env)
            res["pssh"].append(dt)
            ok["pssh"] = out.count("[SUCCESS]")
    med = {k: statistics.median(v) for k, v in res.items() if v}
    return {"median_s": med, "runs_s": res, "hosts_ok": ok,
            "ratio_loop": med["ssh-loop"] / med["gputop"],
            "ratio_pssh": (med["pssh"] / med["gputop"]) if "pssh" in med else None}


def steady(fleet: Fleet, seconds: float, interval: float = 2.0) -> dict[str, object]:
    cfg = fleet.write_config(timeout=10.0, interval=interval)
    before = connections(fleet)
    proc = subprocess.Popen([PY, "-m", "gputop", "--json", "--watch", "--config", str(cfg)],
                            env=fleet.env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    assert proc.stdout is not None
    arrivals: list[float] = []
    complete: list[bool] = []
    first_cpu = 0.0
    deadline = None
    while True:
        line = proc.stdout.readline()
        if not line:
            break
        now = time.monotonic()
        arrivals.append(now)
        doc = json.loads(line)
        complete.append(all(h["status"] == "ok" for h in doc["hosts"]))
        if len(arrivals) == 1:  # count from the first complete snapshot on: steady state
            first_cpu = _cpu(proc.pid)
            deadline = now + seconds
        elif deadline is not None and now >= deadline:
            break
    cpu = _cpu(proc.pid) - first_cpu
    rss = _peak_rss_mb(proc.pid)
    proc.terminate()
    proc.wait(10)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    refreshes = len(gaps)
    opened = connections(fleet) - before
    return {"interval_s": interval, "refreshes": refreshes,
            "gap_median_s": statistics.median(gaps) if gaps else None,
            "gap_max_s": max(gaps) if gaps else None,
            "all_complete": all(complete),
            "cpu_s_per_refresh": cpu / refreshes if refreshes else None,
            "cpu_percent_of_core": 100 * cpu / (arrivals[-1] - arrivals[0]) if gaps else None,
            "peak_rss_mb": rss, "ssh_connections_opened": opened, "hosts": len(fleet.hosts)}


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def board(hosts: int, gpus: int, seconds: float) -> dict[str, object]:
    out = subprocess.run([PY, "-m", "bench.board_cpu", "--hosts", str(hosts),
                          "--gpus", str(gpus), "--seconds", str(seconds)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def find_pssh() -> str | None:
    for name in ("parallel-ssh", "pssh"):
        if shutil.which(name):
            return shutil.which(name)
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-qq", "pssh"], capture_output=True)
        return shutil.which("parallel-ssh")
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="10,50,200")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steady", type=float, default=60.0, help="seconds of --watch per size")
    ap.add_argument("--steady-sizes", default="50,200")
    ap.add_argument("--latency", type=float, default=0.15)
    ap.add_argument("--scale", type=int, default=500, help="0 to skip the scale check")
    ap.add_argument("--board-seconds", type=float, default=30.0)
    args = ap.parse_args()
    reason = sshd_available()
    if reason:
        print(f"bench: {reason}", file=sys.stderr)
        return 2
    pssh = find_pssh()
    if not pssh:
        print("bench: parallel-ssh not found (apt-get install pssh); its column is skipped",
              file=sys.stderr)
    results: dict[str, object] = {"latency_s": args.latency, "cores": os.cpu_count(),
                                  "cold": {}, "steady": {}}
    sizes = [int(x) for x in args.sizes.split(",") if x]
    steady_sizes = {int(x) for x in args.steady_sizes.split(",") if x}
    for n in sizes:
        print(f"N = {n}", flush=True)
        root = Path(tempfile.mkdtemp(prefix=f"gputop-bench-{n}-"))
        os.chmod(root, 0o755)
        fleet = up(n, args.latency, root)
        try:
            c = cold(fleet, args.runs, pssh)
            results["cold"][str(n)] = c  # type: ignore[index]
            print(f"  cold medians {c['median_s']}  ok {c['hosts_ok']}", flush=True)
            if n in steady_sizes and args.steady > 0:
                s = steady(fleet, args.steady)
                results["steady"][str(n)] = s  # type: ignore[index]
                print(f"  steady {s}", flush=True)
        finally:
            fleet.stop()
            shutil.rmtree(root, ignore_errors=True)
    print("board 200 x 8", flush=True)
    results["board"] = board(200, 8, args.board_seconds)
    print(f"  {results['board']}", flush=True)
    if args.scale:
        print(f"scale N = {args.scale}", flush=True)
        root = Path(tempfile.mkdtemp(prefix="gputop-bench-scale-"))
        os.chmod(root, 0o755)
        fleet = up(args.scale, args.latency, root)
        try:
            cfg = fleet.write_config(timeout=20.0)
            dt, out = timed([PY, "-m", "gputop", "--json", "--config", str(cfg)], fleet.env())
            doc = json.loads(out)
            okc = sum(h["status"] == "ok" for h in doc["hosts"])
            results["scale"] = {"hosts": args.scale, "ok": okc, "seconds": dt,
                                "errors": sorted({h["error"]["kind"] for h in doc["hosts"]
                                                  if h["error"]})}
            print(f"  {results['scale']}", flush=True)
        finally:
            fleet.stop()
            shutil.rmtree(root, ignore_errors=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (OUT / "results.md").write_text(report(results))
    plot(results, OUT / "results.png")
    print((OUT / "results.md").read_text())
    return 0


def report(r: dict) -> str:  # type: ignore[type-arg]
    lines = [f"# gputop benchmark\n\nStand-in nvidia-smi latency {r['latency_s'] * 1000:.0f} ms; "
             f"{r['cores']} cores shared by the fleet's sshd processes and the tools.\n",
             "## Cold: time to a complete snapshot (median)\n",
             "| hosts | gputop --json | ssh loop | parallel-ssh | loop / gputop | pssh / gputop "
             "| hosts answered (gputop / loop / pssh) |",
             "|---:|---:|---:|---:|---:|---:|:---:|"]
    for n, c in r["cold"].items():
        m, ok = c["median_s"], c["hosts_ok"]
        pssh = f"{m['pssh']:.2f} s" if "pssh" in m else "n/a"
        rp = f"{c['ratio_pssh']:.1f}x" if c["ratio_pssh"] else "n/a"
        lines.append(f"| {n} | {m['gputop']:.2f} s | {m['ssh-loop']:.2f} s | {pssh} | "
                     f"{c['ratio_loop']:.1f}x | {rp} | {ok.get('gputop')} / "
                     f"{ok.get('ssh-loop')} / {ok.get('pssh', 'n/a')} |")
    lines += ["", "## Steady state: `gputop --json --watch`, 2 s interval\n",
              "| hosts | refreshes | refresh-to-refresh (median / max) | every refresh complete "
              "| CPU per refresh | CPU % of one core | peak RSS | SSH connections opened |",
              "|---:|---:|---:|:---:|---:|---:|---:|---:|"]
    for n, s in r["steady"].items():
        lines.append(f"| {n} | {s['refreshes']} | {s['gap_median_s']:.2f} s / "
                     f"{s['gap_max_s']:.2f} s | {'yes' if s['all_complete'] else 'NO'} | "
                     f"{s['cpu_s_per_refresh'] * 1000:.0f} ms | {s['cpu_percent_of_core']:.1f} % | "
                     f"{s['peak_rss_mb']:.0f} MB | {s['ssh_connections_opened']} |")
    b = r.get("board")
    if b:
        lines += ["", "## The board (Textual, headless, simulated sources)\n",
                  "| hosts x GPUs | refreshes | CPU per refresh | CPU % of one core | peak RSS |",
                  "|---|---:|---:|---:|---:|",
                  f"| {b['hosts']} x {b['gpus']} | {b['refreshes']} | "
                  f"{b['cpu_per_refresh_s'] * 1000:.0f} ms | {b['cpu_percent_of_core']} % | "
                  f"{b['peak_rss_mb']} MB |"]
    s = r.get("scale")
    if s:
        lines += ["", "## Scale\n", f"`gputop --json` over {s['hosts']} hosts: {s['ok']} healthy "
                  f"in {s['seconds']:.1f} s; errors: {', '.join(s['errors']) or 'none'}."]
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:  # type: ignore[type-arg]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib not installed (pip install -e '.[bench]'); no plot",
              file=sys.stderr)
        return
    ns = list(r["cold"])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.27
    for i, tool in enumerate(("gputop", "pssh", "ssh-loop")):
        vals = [r["cold"][n]["median_s"].get(tool, 0) for n in ns]
        ax.bar([j + (i - 1) * width for j in range(len(ns))], vals, width,
               label={"gputop": "gputop --json", "pssh": "parallel-ssh",
                      "ssh-loop": "for h; ssh h nvidia-smi; done"}[tool])
    ax.set_xticks(range(len(ns)), [f"{n} hosts" for n in ns])
    ax.set_ylabel("seconds to a complete snapshot (median)")
    ax.set_yscale("log")
    ax.set_title(f"Cold snapshot, stand-in nvidia-smi {r['latency_s'] * 1000:.0f} ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
