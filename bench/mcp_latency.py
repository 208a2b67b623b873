"""What an agent's question costs: ``gputop mcp``'s tools against running the commands.

Brings up N real sshd hosts (``tests/support/fleet.py``), starts ``gputop mcp`` with the MCP SDK's
stdio client, and times, side by side: ``fleet_status`` and ``find_gpus`` over the kept
server (the first call connects; the rest reuse each host's connection), and what an
agent without MCP would run for the same answer, ``gputop --json`` and ``gputop free``,
each a new process that connects to every host. Counts the SSH logins each way.

    python -m bench.mcp_latency --hosts 20 --runs 5

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from bench.run import PY, connections, timed, up

ROOT = Path(__file__).resolve().parents[1]


async def over_mcp(cfg: Path, env: dict[str, str], runs: int, fleet: object
                   ) -> dict[str, object]:
    params = StdioServerParameters(command=PY, args=["-m", "gputop", "mcp", "--config",
                                                     str(cfg)], env=env)
    out: dict[str, object] = {}
    async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
        t = time.monotonic()
        await s.initialize()
        out["start_s"] = round(time.monotonic() - t, 3)
        t = time.monotonic()
        first = await s.call_tool("fleet_status", {})
        out["first_fleet_status_s"] = round(time.monotonic() - t, 3)
        assert not first.is_error, first
        before = connections(fleet)  # type: ignore[arg-type]
        for tool, args in (("fleet_status", {}), ("find_gpus", {"count": 1})):
            times = []
            for _ in range(runs):
                t = time.monotonic()
                res = await s.call_tool(tool, args)
                times.append(time.monotonic() - t)
                assert not res.is_error, res
            out[f"{tool}_median_s"] = round(statistics.median(times), 3)
        out["logins_during_warm_calls"] = connections(fleet) - before  # type: ignore[arg-type]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=20)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gputop-bench-mcp-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)
        fleet = up(a.hosts, 0.0, root)
        try:
            cfg = fleet.write_config(timeout=30.0)
            env = fleet.env()
            res: dict[str, object] = {"hosts": a.hosts, "runs": a.runs}
            res["mcp"] = asyncio.run(over_mcp(cfg, env, a.runs, fleet))
            for name, argv in (("json", ["--json"]), ("free", ["free", "--count", "1"])):
                before = connections(fleet)
                times = [timed([PY, "-m", "gputop", "--config", str(cfg), *argv], env)[0]
                         for _ in range(a.runs)]
                res[f"gputop_{name}_median_s"] = round(statistics.median(times), 3)
                res[f"gputop_{name}_logins"] = connections(fleet) - before
            print(json.dumps(res))
        finally:
            fleet.stop()


if __name__ == "__main__":
    main()
