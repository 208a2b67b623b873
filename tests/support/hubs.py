"""Test helpers for the hub: start ``gputop serve`` on loopback, read it over HTTP and SSE."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def get(url: str, headers: dict[str, str] | None = None,
        timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


class Hub:
    """One ``gputop serve`` process."""

    def __init__(self, config: Path, env: dict[str, str], address: str = "127.0.0.1",
                 port: int | None = None, extra: tuple[str, ...] = ()) -> None:
        self.config, self.env, self.address = config, env, address
        self.port = port or free_port(address)
        self.extra = extra
        self.proc: subprocess.Popen[str] | None = None
        self.stderr_path = config.parent / f"hub-{self.port}.stderr"

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}/"

    def start(self, *, wait_ready: float | None = 30.0) -> Hub:
        err = open(self.stderr_path, "a")  # noqa: SIM115 - the process keeps it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gputop", "serve", "--config", str(self.config),
             "--listen", f"{self.address}:{self.port}", *self.extra],
            env=self.env, stdout=subprocess.DEVNULL, stderr=err, text=True)
        err.close()
        deadline = time.monotonic() + (wait_ready or 15.0)
        want = "-/ready" if wait_ready else "-/healthy"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"hub exited {self.proc.returncode}: {self.stderr()}")
            try:
                status, _, _ = get(self.url + want, timeout=2)
                if status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"hub not {want} in time: {self.stderr()}")

    def stderr(self) -> str:
        return self.stderr_path.read_text() if self.stderr_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        rc = self.proc.returncode
        self.proc = None
        return rc

    def json(self, path: str) -> Any:
        status, _, body = get(self.url + path)
        assert status == 200, (status, body[:200])
        return json.loads(body)


class DemoHub:
    """tests/support/demo_hub.py as a process; its stderr kept."""

    def __init__(self, tmp: Path, address: str, *args: str) -> None:
        self.port = free_port(address)
        self.url = f"http://{address}:{self.port}/"
        self.err = tmp / f"hub-{self.port}.stderr"
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.demo_hub",
                                          "--listen", f"{address}:{self.port}", *args],
                                         stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.stderr()
            try:
                if get(self.url + "-/ready", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"demo hub not ready: {self.stderr()}")

    def stderr(self) -> str:
        return self.err.read_text()

    def rss_mib(self) -> float:
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024  # type: ignore[union-attr]

    def metric(self, name: str, via: socket.socket | None = None) -> float:
        """One of /metrics' values; ``via``: asked over that open connection, not a new one
        (which a hub at its --max-connections would refuse)."""
        if via is None:
            body = get(self.url + "metrics")[2].decode()
        else:
            c = http.client.HTTPConnection("unused", timeout=10)
            c.sock = via
            c.request("GET", "/metrics", headers={"Host": self.url.split("/")[2]})
            body = c.getresponse().read().decode()
        return float(re.search(rf"^{name} (\S+)$", body, re.M).group(1))  # type: ignore[union-attr]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


class Sse:
    """A raw SSE reader (http.client), so the test sees exactly what is on the wire."""

    def __init__(self, hub_url: str, last_event_id: str | None = None,
                 timeout: float = 20.0) -> None:
        host, port = hub_url.split("//")[1].rstrip("/").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        headers = {"Accept": "text/event-stream"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        self.conn.request("GET", "/api/v1/events", headers=headers)
        self.resp = self.conn.getresponse()
        self.lines: list[str] = []

    def events(self) -> Iterator[dict[str, str]]:
        """Each event's fields (``event``, ``id``, ``data``); every raw line is kept."""
        ev: dict[str, str] = {}
        while True:
            raw = self.resp.readline()
            if not raw:
                return
            line = raw.decode().rstrip("\n")
            self.lines.append(line)
            if not line:
                if "data" in ev:
                    yield ev
                ev = {}
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(": ")
            ev[name] = value

    def close(self) -> None:
        self.conn.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
