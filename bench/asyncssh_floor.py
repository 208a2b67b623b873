"""The floor under ``gputop --json --watch``: what asyncssh alone costs per host per refresh.

Brings up N real sshd hosts (``tests/support/fleet.py``), opens one asyncssh connection and one
session per host whose remote loop prints four 150-byte lines (a 4-GPU sample's size)
every 2 s, and counts this process's CPU while it only receives them (a callback that
counts bytes: no parsing, no document). ``--pace`` runs it on gputop's paced loop
(gputop.pacing) at that pace; 0 is asyncio's own loop.

    python -m bench.asyncssh_floor --hosts 200 --seconds 30 --pace 0,0.25

Prints one JSON line per pace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import asyncssh

from bench.run import up
from gputop import pacing
from gputop.ssh.transport import resolve_options

ROOT = Path(__file__).resolve().parents[1]

LINE = "g " + "x" * 148
#: Ends with the session: the loop's printf fails once the channel is gone.
COMMAND = f"while printf '%s\\n%s\\n%s\\n%s\\n' {LINE} {LINE} {LINE} {LINE}; do sleep 2; done"


class _Count(asyncssh.SSHClientSession[bytes]):
    packets = 0

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        _Count.packets += 1


async def measure(hosts: int, seconds: float, pace: float) -> dict[str, object]:
    async def one(i: int) -> asyncssh.SSHClientConnection:
        conn = await asyncssh.connect(options=resolve_options(f"h{i:03d}", ssh_config=None))
        await conn.create_session(_Count, COMMAND, encoding=None)
        return conn

    conns = await asyncio.gather(*(one(i) for i in range(hosts)))
    try:
        await asyncio.sleep(3)
        pacing.set_pace(pace)
        t0, c0, p0 = time.monotonic(), time.process_time(), _Count.packets
        await asyncio.sleep(seconds)
        wall, cpu = time.monotonic() - t0, time.process_time() - c0
        packets = _Count.packets - p0
    finally:
        for c in conns:
            c.close()
    return {"hosts": hosts, "pace_s": pace, "cpu_percent_of_core": round(100 * cpu / wall, 2),
            "packets_per_s": round(packets / wall, 1),
            "cpu_us_per_packet": round(1e6 * cpu / max(1, packets)),
            "load": round(os.getloadavg()[0], 1)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--pace", default="0,0.25")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gputop-floor-"))
    os.chmod(root, 0o755)
    fleet = up(args.hosts, 0.15, root)
    home = os.environ.get("HOME")
    os.environ["HOME"] = fleet.env()["HOME"]  # the fleet's ~/.ssh (keys, known_hosts)
    try:
        for pace in (float(p) for p in args.pace.split(",")):
            print(json.dumps(pacing.run_paced(measure(args.hosts, args.seconds, pace))),
                  flush=True)
    finally:
        if home is not None:
            os.environ["HOME"] = home
        fleet.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
