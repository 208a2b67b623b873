"""Where ``gputop --json --watch`` spends its CPU, per host per refresh, on the real fleet.

Brings up N real sshd hosts (``tests/support/fleet.py``, as ``bench/run.py`` does), runs
``python -m cProfile -m gputop --json --watch`` against them for ``--seconds`` from the
first document in which every host answered (at most 10 lines in), stops it with SIGINT
(the profile is written on exit), and groups
the profile's own time by where the code lives: asyncssh (split into its packet path,
cipher and channel code), asyncio, gputop's parse, the document (annotate, to_dict, JSON),
and the rest. Each ``--variant`` is one run on the same fleet:

    default       the code as it is (AES-GCM preferred, see ssh/transport.py)
    chacha        ~/.ssh/config says ``Ciphers chacha20-poly1305@openssh.com``
    noprofile     no profiler: the plain CPU % (cProfile inflates Python-heavy parts)

Each runs with the config's default ``collection = "stream"``; a variant whose name holds
``query`` (``query``, ``noprofile-query``) runs with ``collection = "query"``.

    python -m bench.watch_profile --hosts 200 --seconds 30 --variant noprofile,noprofile-query

Prints one JSON line per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.run import _cpu, up
from tests.support.fleet import Fleet

ROOT = Path(__file__).resolve().parents[1]

#: gputop --json --watch with the profiler switched on after the first document (the
#: handshakes are start-up, not steady state) and written out on exit.
PROFILED = """
import atexit, cProfile, sys, time
import gputop.output as output
path = sys.argv.pop(1)
name = "write_line" if hasattr(output, "write_line") else "write_document"  # (older trees)
prof, seen, write = cProfile.Profile(time.process_time), [0], getattr(output, name)
def counted(doc, stream, **kw):
    write(doc, stream, **kw)
    seen[0] += 1
    if seen[0] == 1 and path:
        prof.enable()
setattr(output, name, counted)
atexit.register(lambda: path and (prof.disable(), prof.dump_stats(path)))
from gputop.cli import main
sys.exit(main(sys.argv[1:]))
"""

GROUPS = (  # first match wins: (name, substring of the function's file or name)
    ("asyncssh cipher", "asyncssh/crypto"),
    ("asyncssh packet", "asyncssh/packet"),
    ("asyncssh connection", "asyncssh/connection"),
    ("asyncssh channel", "asyncssh/channel"),
    ("asyncssh stream/process", "asyncssh/"),
    ("cryptography (C)", "cryptography"),
    ("asyncio", "asyncio/"),
    ("gputop parse", "gputop/sources/nvidia_smi"),
    ("gputop ssh source", "gputop/sources/ssh"),
    ("gputop ssh source", "gputop/ssh/transport"),
    ("gputop ssh source", "gputop/sources/query"),
    ("gputop ssh source", "gputop/sources/stream_collector"),
    ("gputop document", "gputop/model"),
    ("gputop document", "gputop/output"),
    ("gputop document", "gputop/reservations/flags"),
    ("json", "json/"),
    ("gputop other", "gputop/"),
)


def group(stats: pstats.Stats) -> dict[str, float]:
    out: dict[str, float] = {}
    raw = stats.stats  # type: ignore[attr-defined]
    for (path, _line, name), (_cc, _nc, tottime, _ct, _callers) in raw.items():
        where = f"{path}:{name}"
        key = next((g for g, s in GROUPS if s in where), None)
        if key is None:
            key = "socket/select/C" if path == "~" else "other python"
        out[key] = out.get(key, 0.0) + tottime
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def watch(fleet_env: dict[str, str], cfg: Path, seconds: float, profile: Path | None,
          src: str | None = None) -> dict[str, object]:
    cmd = [sys.executable, "-c", PROFILED, str(profile or ""),
           "--json", "--watch", "--config", str(cfg)]
    env = dict(fleet_env, PYTHONPATH=src) if src else fleet_env
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=src or ROOT)
    assert proc.stdout is not None
    docs = skipped = 0
    cpu0 = t0 = 0.0
    complete = False
    while True:
        line = proc.stdout.readline()
        if not line:
            break
        doc = json.loads(line)
        if docs == 0:
            # Steady state: from the first line in which every host answered (start-up, the
            # handshakes and the first samples, is bench/streaming.py's cold start).
            complete = all(h["status"] == "ok" for h in doc["hosts"])
            if not complete and skipped < 10:
                skipped += 1
                continue
            cpu0, t0 = _cpu(proc.pid), time.monotonic()
        docs += 1
        if docs > 1 and time.monotonic() - t0 >= seconds:
            break
    cpu, wall = _cpu(proc.pid) - cpu0, time.monotonic() - t0
    proc.send_signal(signal.SIGINT)
    # Read on until it exits: a 200-host line is bigger than a pipe holds, and a writer
    # blocked on a full pipe never gets to its signal handler.
    for _ in proc.stdout:
        pass
    proc.wait(60)
    return {"refreshes": docs - 1, "cpu_percent_of_core": round(100 * cpu / wall, 2),
            "cpu_ms_per_refresh": round(1000 * cpu / max(1, docs - 1), 1),
            "first_complete": complete, "lines_skipped": skipped}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--variant", default="default,chacha,noprofile")
    ap.add_argument("--before", metavar="DIR",
                    help="also run each variant with the gputop found in DIR (e.g. `git "
                         "archive REV | tar -x -C DIR`), labelled \"before\"")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gputop-watchprof-"))
    os.chmod(root, 0o755)
    fleet = up(args.hosts, 0.15, root)
    try:
        ssh_config = fleet.home / ".ssh" / "config"
        original = ssh_config.read_text()
        for variant in args.variant.split(","):
            ssh_config.write_text(
                ("Ciphers chacha20-poly1305@openssh.com\n\n" if "chacha" in variant else "")
                + original)
            collection = "query" if "query" in variant else "stream"
            cfg = fleet.write_config(timeout=10.0, interval=2.0,
                                     extra=f'collection = "{collection}"\n')
            for src in ([args.before] if args.before else []) + [None]:
                run_variant(fleet, root, cfg, variant, collection, args, src)
        ssh_config.write_text(original)
    finally:
        fleet.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


def run_variant(fleet: Fleet, root: Path, cfg: Path, variant: str, collection: str,
                args: argparse.Namespace, src: str | None) -> None:
    prof = None if "noprofile" in variant else root / f"{variant}.prof"
    out: dict[str, object] = {"variant": variant, "collection": collection,
                              "code": "before" if src else "after", "hosts": args.hosts,
                              **watch(fleet.env(), cfg, args.seconds, prof, src)}
    if prof is not None and prof.exists():
        stats = pstats.Stats(str(prof))
        total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
        out["profile_share_percent"] = {k: round(100 * v / total, 1)
                                        for k, v in group(stats).items()}
        kept = Path(tempfile.gettempdir()) / f"gputop-watch-{variant}.prof"
        stats.dump_stats(str(kept))
        out["profile"] = str(kept)  # pstats: python -m pstats PATH
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
