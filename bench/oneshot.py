"""One-shot commands with one hung host, direct (no hub): time to answer.

Brings up 4 healthy real sshd hosts and 1 whose nvidia-smi never returns
(``tests/support/fleet.py``'s "hang" scenario), with the default ``timeout`` (10 s) and
``first_answer`` (2 s), and times ``gputop --json``, ``gputop free`` and ``gputop --once``
as new processes, each with and without ``--wait-all`` (which waits as every one-shot did
before the first-answer deadline). Checks that the hung host is reported (``slow``, or
``timeout`` with ``--wait-all``).

    python -m bench.oneshot --runs 3

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.fleet import Fleet, Host

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = {"--json": ["--json"], "free": ["free", "--count", "1"], "--once": ["--once"]}


def one(cfg: Path, env: dict[str, str], args: list[str]) -> tuple[float, str]:
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "gputop", "--config", str(cfg), *args],
                       env=env, capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    took = time.monotonic() - t
    said = r.stdout + r.stderr
    kind = "slow" if "slow" in said else "timeout" if "timeout" in said else "?"
    return took, kind


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gputop-oneshot-", dir="/tmp"))
    root.chmod(0o755)
    hosts = [Host(f"ok{i}", f"127.0.73.{i + 2}", gpus=("rtx2080",)) for i in range(4)]
    hosts.append(Host("hung", "127.0.73.9", scenario="hang"))
    fleet = Fleet(root, hosts).start()
    try:
        cfg = fleet.write_config(timeout=10.0, interval=2.0, wait_all=False)
        env = fleet.env() | {"COLUMNS": "200"}
        out: dict[str, object] = {"hosts": "4 healthy + 1 hung", "timeout_s": 10.0,
                                  "first_answer_s": 2.0, "runs": args.runs,
                                  "python": platform.python_version()}
        for name, argv in COMMANDS.items():
            for wait_all in (False, True):
                key = name + (" --wait-all" if wait_all else "")
                times, kinds = [], set()
                for _ in range(args.runs):
                    took, kind = one(cfg, env, argv + (["--wait-all"] if wait_all else []))
                    times.append(took)
                    kinds.add(kind)
                out[key] = {"median_s": round(statistics.median(times), 2),
                            "max_s": round(max(times), 2), "hung_host_shown_as": sorted(kinds)}
                print(f"  {key}: {out[key]}", file=sys.stderr, flush=True)
        print(json.dumps(out))
    finally:
        fleet.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
