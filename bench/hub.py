"""The hub against direct collection, side by side in one run.

    python -m bench.hub hosts    [--hosts 8 --clients 10 --seconds 20]   # real sshd
    python -m bench.hub hung     [--runs 3]                              # real sshd
    python -m bench.hub latency  [--changes 5]                           # real sshd
    python -m bench.hub demo-hub --hosts 200 --gpus 8 --listen 127.0.0.1:9850
    python -m bench.hub hub-cpu  [--hosts 200 --gpus 8 --seconds 20]     # simulated feed

- ``hosts``: N real sshd hosts (``tests/support/fleet.py``); ``--clients`` ``gputop --json
  --watch`` processes read the hosts directly, then the same number read one hub. Host
  side: CPU of everything under each host's sshd per second, and the SSH connections
  each host holds; client side: the clients' (and the hub's) CPU.
- ``hung``: the same fleet plus one host that never answers: wall time of ``--json``,
  ``--once`` and ``free`` direct and through the hub (each a fresh process).
- ``latency``: a GPU process started on a host; time until a hub's SSE subscriber sees it,
  and until a direct ``--json --watch`` prints it, against the interval.
- ``demo-hub``: a hub over simulated hosts (``DemoSource``), for the board's benchmark
  (``bench/board_cpu.py --hub URL``) and ``hub-cpu``.
- ``hub-cpu``: the hub's own CPU at 200 simulated hosts with 0, 10 and 50 SSE subscribers
  (each a reader process that parses every event).

Prints JSON lines; bench/results/hub.md holds the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.fleet import Fleet, GpuProcess, Host

ROOT = Path(__file__).resolve().parents[1]

PY = sys.executable
TICK = os.sysconf("SC_CLK_TCK")


def host_cpu(fleet: Fleet) -> float:
    """CPU seconds, to the nanosecond (``/proc/PID/task/*/schedstat``), of every process
    under every host's sshd: everything the hosts run for their readers. (The clock-tick
    counters of ``/proc/PID/stat`` round each process down to 10 ms: the streams' few
    milliseconds per process would read as nothing.) Processes that end inside the window
    are not counted: in steady state the streams start and end none."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    todo = [h.proc.pid for h in fleet.hosts.values() if h.proc is not None]
    total = 0
    while todo:
        pid = todo.pop()
        try:
            for t in Path(f"/proc/{pid}/task").iterdir():
                total += int((t / "schedstat").read_text().split()[0])
        except OSError:
            pass
        todo.extend(children.get(pid, []))
    return total / 1e9


def cpu_of(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in f[11:15]) / TICK


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def connections(fleet: Fleet) -> dict[str, int]:
    """Established TCP connections to each host's sshd (from /proc/net/tcp)."""
    want = {}
    for h in fleet.hosts.values():
        a = socket.inet_aton(h.address)
        want[f"{int.from_bytes(a, 'little'):08X}:{h.port:04X}"] = h.name
    out = dict.fromkeys(want.values(), 0)
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[3] == "01" and f[1] in want:
            out[want[f[1]]] += 1
    return out


def up(n: int, root: Path, hung: bool = False) -> Fleet:
    hosts = [Host(f"h{i:02d}", f"127.0.60.{2 + i}", gpus=("h100", "h100", "l40s", "rtx2080"),
                  processes=[GpuProcess("gtalice", f"python job{i}.py")]) for i in range(n)]
    if hung:
        hosts.append(Host("hung", f"127.0.60.{2 + n}", scenario="hang"))
    os.chmod(root, 0o755)
    return Fleet(root, hosts).start()


def start_hub(cfg: Path, env: dict[str, str], addr: str = "127.0.60.1"
              ) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port(addr)
    proc = subprocess.Popen([PY, "-m", "gputop", "serve", "--config", str(cfg), "--listen",
                             f"{addr}:{port}", "--max-subscribers", "200",
                             "--max-subscribers-per-client", "200"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://{addr}:{port}/"
    import urllib.request

    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "-/ready", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit("the hub never got ready")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def watchers(cfg: Path, env: dict[str, str], n: int, hub: str | None
             ) -> list[subprocess.Popen[bytes]]:
    extra = ["--hub", hub] if hub else []
    return [subprocess.Popen([PY, "-m", "gputop", "--json", "--watch", "--config", str(cfg),
                              *extra], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) for _ in range(n)]


def bench_hosts(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        fleet = up(args.hosts, Path(d))
        try:
            cfg = fleet.write_config(timeout=10.0, interval=2.0)
            env = fleet.env()
            rows = []
            for mode in ("direct", "hub", "direct", "hub"):  # alternating: drift shows
                hub = url = None
                if mode == "hub":
                    hub, url = start_hub(cfg, env)
                clients = watchers(cfg, env, args.clients, url)
                time.sleep(args.warmup)
                conns = connections(fleet)
                h0, t0 = host_cpu(fleet), time.monotonic()
                c0 = sum(cpu_of(p.pid) for p in clients)
                k0 = cpu_of(hub.pid) if hub else 0.0
                time.sleep(args.seconds)
                wall = time.monotonic() - t0
                hosts_cpu = host_cpu(fleet) - h0
                clients_cpu = sum(cpu_of(p.pid) for p in clients) - c0
                hub_cpu = (cpu_of(hub.pid) - k0) if hub else 0.0
                for p in clients:
                    stop(p)  # type: ignore[arg-type]
                if hub:
                    stop(hub)
                row = {"mode": mode, "hosts": args.hosts, "clients": args.clients,
                       "seconds": round(wall, 1),
                       "host_side_cpu_ms_per_host_per_s":
                           round(1000 * hosts_cpu / wall / args.hosts, 2),
                       "ssh_connections_per_host": sorted(set(conns.values())),
                       "clients_cpu_percent_of_core": round(100 * clients_cpu / wall, 1),
                       "hub_cpu_percent_of_core": round(100 * hub_cpu / wall, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                time.sleep(2)
        finally:
            fleet.stop()


def bench_hung(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        fleet = up(args.hosts, Path(d), hung=True)
        try:
            cfg = fleet.write_config(timeout=10.0, interval=2.0)
            env = fleet.env()
            hub, url = start_hub(cfg, env)
            try:
                for how in ("direct", "hub"):
                    for what in (["--json"], ["--once"], ["free"]):
                        times = []
                        for _ in range(args.runs):
                            t = time.monotonic()
                            subprocess.run([PY, "-m", "gputop", *what, "--config", str(cfg),
                                            *(["--hub", url] if how == "hub" else [])],
                                           env=env, capture_output=True, timeout=120)
                            times.append(time.monotonic() - t)
                        print(json.dumps({"mode": how, "command": " ".join(what),
                                          "hung_host_timeout_s": 10.0,
                                          "wall_s": [round(x, 2) for x in times]}),
                              flush=True)
                t = time.monotonic()
                subprocess.run([PY, "-c", "import gputop.cli.main"], env=env, timeout=60)
                print(json.dumps({"python_and_import_s": round(time.monotonic() - t, 2)}))
            finally:
                stop(hub)
        finally:
            fleet.stop()


def bench_latency(args: argparse.Namespace) -> None:
    import http.client

    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        fleet = up(2, Path(d))
        try:
            interval = 2.0
            cfg = fleet.write_config(timeout=10.0, interval=interval)
            env = fleet.env()
            hub, url = start_hub(cfg, env)
            host, port = url.split("//")[1].rstrip("/").split(":")
            direct = subprocess.Popen([PY, "-m", "gputop", "--json", "--watch", "--config",
                                       str(cfg)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)
            time.sleep(6)
            h = fleet.hosts["h00"]
            out = []
            try:
                for i in range(args.changes):
                    conn = http.client.HTTPConnection(host, int(port), timeout=30)
                    conn.request("GET", "/api/v1/events")
                    resp = conn.getresponse()
                    resp.readline()
                    p = GpuProcess("gtbob", f"python change{i}.py", gpu=1, mem_mib=100)
                    h.processes.append(p)
                    fleet.start_process(p)
                    fleet.set_scenario(h, "ok")
                    t0 = time.monotonic()
                    hub_s = direct_s = None
                    assert direct.stdout is not None
                    while hub_s is None:
                        line = resp.readline().decode()
                        if line.startswith("data: ") and f'"pid":{p.pid},' in line:
                            hub_s = time.monotonic() - t0
                    conn.close()
                    while direct_s is None:
                        line = direct.stdout.readline()
                        if f'"pid":{p.pid},' in line:
                            direct_s = time.monotonic() - t0
                    out.append((hub_s, direct_s))
                    print(json.dumps({"change": i, "interval_s": interval,
                                      "hub_subscriber_s": round(hub_s, 3),
                                      "direct_watch_s": round(direct_s, 3)}), flush=True)
                    time.sleep(1.0 + i * 0.37)  # land at other points of the interval
                print(json.dumps({"hub_median_s": round(statistics.median(x for x, _ in out), 3),
                                  "hub_max_s": round(max(x for x, _ in out), 3),
                                  "direct_median_s":
                                      round(statistics.median(y for _, y in out), 3)}))
            finally:
                stop(hub)
                direct.terminate()
                direct.wait(10)
        finally:
            fleet.stop()


def demo_config(hosts: int, interval: float):  # type: ignore[no-untyped-def]
    from gputop.config.load import Config
    from gputop.config.tables import Defaults, HostConfig, Reservations

    names = [f"node{i:03d}" for i in range(hosts)]
    return Config(path=None, hosts=tuple(HostConfig(n) for n in names),
                  defaults=Defaults(interval=interval, timeout=5.0),
                  reservations=Reservations(path=Path(tempfile.mkdtemp()) / "r.json"))


def run_demo_hub(args: argparse.Namespace) -> None:
    from gputop.cli.lifecycle import run_until_signal
    from gputop.hub.collector import Collector
    from gputop.hub.server import serve
    from gputop.poller import Poller
    from gputop.sources.demo import DemoSource

    cfg = demo_config(args.hosts, args.interval)
    sources = [DemoSource(h.name, "NVIDIA H100 80GB HBM3", args.gpus, 81559, 700.0)
               for h in cfg.hosts]

    async def main() -> int:  # SIGTERM, SIGINT, SIGHUP end it cleanly (run_until_signal)
        collector = Collector(cfg, Poller(cfg, sources))
        await serve(cfg, args.listen, collector=collector, max_subscribers=200,
                    max_subscribers_per_client=200)  # (every stream from one address)
        return 0

    run_until_signal(main)


READER = r"""
import json, sys, http.client
host, port = sys.argv[1], int(sys.argv[2])
c = http.client.HTTPConnection(host, port, timeout=60)
c.request("GET", "/api/v1/events")
r = c.getresponse()
for line in r:
    if line.startswith(b"data: "):
        json.loads(line[6:])
"""


def bench_hub_cpu(args: argparse.Namespace) -> None:
    addr = "127.0.61.1"
    port = free_port(addr)
    hub = subprocess.Popen([PY, str(Path(__file__)), "demo-hub", "--hosts", str(args.hosts),
                            "--gpus", str(args.gpus), "--listen", f"{addr}:{port}"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(args.warmup)
        for n in (0, 10, 50, 0):
            readers = [subprocess.Popen([PY, "-c", READER, addr, str(port)])
                       for _ in range(n)]
            time.sleep(3)
            c0, t0 = cpu_of(hub.pid), time.monotonic()
            r0 = sum(cpu_of(r.pid) for r in readers)
            time.sleep(args.seconds)
            wall = time.monotonic() - t0
            row = {"hosts": args.hosts, "gpus": args.gpus, "subscribers": n,
                   "hub_cpu_percent_of_core": round(100 * (cpu_of(hub.pid) - c0) / wall, 1),
                   "readers_cpu_percent_of_core_each":
                       round(100 * (sum(cpu_of(r.pid) for r in readers) - r0) / wall / n, 2)
                       if n else None}
            print(json.dumps(row), flush=True)
            for r in readers:
                r.kill()
                r.wait()
    finally:
        hub.send_signal(signal.SIGTERM)
        hub.wait(15)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("hosts", "hung", "latency", "demo-hub", "hub-cpu"))
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=8.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--changes", type=int, default=5)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--listen", default="127.0.0.1:9850")
    args = ap.parse_args()
    {"hosts": bench_hosts, "hung": bench_hung, "latency": bench_latency,
     "demo-hub": run_demo_hub, "hub-cpu": bench_hub_cpu}[args.what](args)


if __name__ == "__main__":
    main()
