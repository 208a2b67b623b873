"""A hostile hub that a teammate's ``gputop --hub URL`` points at: a listener on loopback
that sends what it likes. Each answer must end as one classified error or cleaned data,
never a crash, a hang or a byte the reader's terminal would take for its own."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gputop.hubclient.client import _sse, check_document
from gputop.text import clean

ADDR = "127.0.24.1"
Answer = Callable[[socket.socket], None]


def _doc(text: str) -> dict[str, object]:
    gpu = {"index": 0, "uuid": "GPU-1", "name": "H100" + text, "utilization_percent": 5,
           "memory_used_mib": 1, "memory_total_mib": 2, "temperature_c": None,
           "power_draw_w": 1.5, "processes": [{"pid": 1, "user": "u" + text,
                                                "command": "train" + text,
                                                "gpu_memory_mib": 1}],
           "instances": [], "reservation": None, "flags": []}
    return {"version": 5, "time": "2026-01-01T00:00:00Z", "hosts": [
        {"name": "a" + text, "status": "ok", "error": None, "gpus": [gpu]}], "queue": []}


class FakeHub:
    """A loopback listener that answers every connection with ``answer`` (on a thread)."""

    def __init__(self, answer: Answer) -> None:
        self.srv = socket.socket()
        self.srv.bind((ADDR, 0))
        self.srv.listen(8)
        self.srv.settimeout(0.2)
        self.url = f"http://{ADDR}:{self.srv.getsockname()[1]}/"
        self.stop = threading.Event()
        self.answer = answer
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                c, _ = self.srv.accept()
            except OSError:
                continue
            threading.Thread(target=self._one, args=(c,), daemon=True).start()

    def _one(self, c: socket.socket) -> None:
        try:
            c.settimeout(5)
            c.recv(65536)
            self.answer(c)
        except OSError:
            pass
        finally:
            c.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.srv.close()


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("GPUTOP_")}
    for k in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "TMPDIR", "HOME"):
        (tmp_path / k).mkdir()
        e[k] = str(tmp_path / k)
    e["LANG"] = e["LC_ALL"] = "C.UTF-8"
    return e


def gputop(env: dict[str, str], *args: str, timeout: float = 60
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gputop", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def _body(body: bytes) -> Answer:
    def send(c: socket.socket) -> None:
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    return send


@pytest.fixture
def surrogate_hub() -> Iterator[FakeHub]:
    # json.dumps writes a lone surrogate as the escape \ud800: valid JSON, which Python
    # reads back as a str no terminal (UTF-8) can be written.
    hub = FakeHub(_body(json.dumps(_doc("\udcff\ud800")).encode()))
    yield hub
    hub.close()


def test_lone_surrogates_from_a_hub_are_dropped_as_they_are_checked() -> None:
    doc = check_document(json.loads(json.dumps(_doc("\ud800"))))
    host = doc["hosts"][0]
    assert host["name"] == "a"
    assert host["gpus"][0]["name"] == "H100"
    assert host["gpus"][0]["processes"][0]["command"] == "train"
    assert clean("x\udcffy") == "xy"
    json.dumps(doc, ensure_ascii=False).encode()  # every string is writable as UTF-8


def test_once_through_a_hub_sending_lone_surrogates_prints_the_table(
        surrogate_hub: FakeHub, env: dict[str, str]) -> None:
    """On main: UnicodeEncodeError from sys.stdout.write, a traceback and exit 1."""
    r = gputop(env, "--once", "--hub", surrogate_hub.url, "--timeout", "5")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "H100" in r.stdout
    r = gputop(env, "--json", "--hub", surrogate_hub.url, "--timeout", "5")
    assert r.returncode == 0, r.stderr
    assert "\\ud800" not in r.stdout and "\\udcff" not in r.stdout


def _drip(c: socket.socket) -> None:
    """A status line, then one header byte every 0.2 s: each read is quick, the
    answer never ends (http.client takes 100 header lines of 64 KiB)."""
    c.sendall(b"HTTP/1.1 200 OK\r\n")
    for _ in range(2000):
        c.sendall(b"X")
        time.sleep(0.2)


def test_a_hub_dripping_its_headers_is_a_timeout_not_a_hang(env: dict[str, str]) -> None:
    """On main the per-read socket timeout never fires: ``--json`` hangs (and SIGTERM
    cannot end it: the worker thread holds the interpreter's exit)."""
    hub = FakeHub(_drip)
    try:
        started = time.monotonic()
        r = gputop(env, "--json", "--hub", hub.url, "--timeout", "1", timeout=90)
        took = time.monotonic() - started
    finally:
        hub.close()
    assert r.returncode == 4, (r.returncode, r.stderr)
    assert ": timeout: " in r.stderr, r.stderr
    assert took < 60, took  # (a bound for a hang, not a timing: the answer is at ~1 s)


class _Content:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def readany(self) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


def test_an_event_of_many_short_data_lines_is_read_in_one_pass() -> None:
    """An event of 200,000 ``data:`` lines: on main each line summed every line before it
    (2 * 10**10 steps: the board's reader spun for hours on one event)."""
    n = 200_000
    content = _Content([b"event: update\n" + b"data: x\n" * n + b"\n"])

    async def read() -> list[tuple[str, str | None, str]]:
        return [item async for item in _sse(content)]

    done: list[list[tuple[str, str | None, str]]] = []
    t = threading.Thread(target=lambda: done.append(asyncio.run(read())), daemon=True)
    t.start()
    t.join(60)  # (a bound for a hang: one pass takes well under a second)
    assert done, "the reader is still summing the event's lines"
    [(event, _, data)] = done[0]
    assert event == "update" and data == "\n".join(["x"] * n)


# --- the hub's own side: sockets that never finish a request ---------------------------------


def test_the_hub_closes_a_socket_that_never_finishes_its_request(tmp_path: Path) -> None:
    """A request line dripped a byte every 0.2 s, and a socket that sends nothing: the
    hub closes both after its idle limit (aiohttp's default kept them an hour, so idle
    sockets from anyone on the machine could use up the hub's file descriptors)."""
    from aiohttp import web

    from gputop.config.load import load_config
    from gputop.hub.server import Hub, make_runner

    cfg = tmp_path / "hosts.toml"
    cfg.write_text(f'[reservations]\npath = "{tmp_path / "r.json"}"\n'
                   '[[hosts]]\nname = "here"\nlocal = true\n')

    async def attack() -> tuple[bool, bool, bytes]:
        hub = Hub(load_config(str(cfg)))
        runner = make_runner(hub, idle_s=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            silent = await asyncio.open_connection("127.0.0.1", port)
            drip = await asyncio.open_connection("127.0.0.1", port)

            async def dripping() -> bool:
                for b in b"GET /-/healthy HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 300:
                    try:
                        drip[1].write(bytes([b]))
                        await drip[1].drain()
                    except ConnectionError:
                        return True
                    if drip[0].at_eof():
                        return True
                    await asyncio.sleep(0.2)
                return False

            async def closed(r: asyncio.StreamReader) -> bool:
                return await r.read(1024) == b""

            drip_closed, silent_closed = await asyncio.wait_for(
                asyncio.gather(dripping(), closed(silent[0])), 30)
            # A client that finishes its request is still answered.
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /-/healthy HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            answer = await asyncio.wait_for(r.read(), 10)
            for s in (silent, drip, (r, w)):
                s[1].close()
            return drip_closed, silent_closed, answer
        finally:
            hub.events.close_all()
            await runner.cleanup()

    drip_closed, silent_closed, answer = asyncio.run(attack())
    assert silent_closed
    assert drip_closed
    assert answer.startswith(b"HTTP/1.1 200")


def test_a_token_or_cookie_that_is_not_utf8_is_refused_not_a_server_error(
        tmp_path: Path) -> None:
    """``Authorization: Bearer \\xff`` (and the cookie): 401 like any wrong token. On main
    the check raised UnicodeEncodeError: a 500 and a log line for each such request."""
    from aiohttp import web

    from gputop.config.load import load_config
    from gputop.hub.server import Hub, make_runner

    cfg = tmp_path / "hosts.toml"
    cfg.write_text(f'[reservations]\npath = "{tmp_path / "r.json"}"\n'
                   '[[hosts]]\nname = "here"\nlocal = true\n')

    async def ask() -> list[bytes]:
        hub = Hub(load_config(str(cfg)), token="secret")
        runner = make_runner(hub)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        out = []
        try:
            for header in (b"Authorization: Bearer \xff\xfe", b"Cookie: gputop_token=\xff",
                           b"Authorization: Bearer secret\xff"):
                r, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(b"GET /api/v1/snapshot HTTP/1.1\r\nHost: 127.0.0.1\r\n" + header
                        + b"\r\nConnection: close\r\n\r\n")
                out.append((await asyncio.wait_for(r.read(), 10)).split(b"\r\n")[0])
                w.close()
        finally:
            hub.events.close_all()
            await runner.cleanup()
        return out

    assert asyncio.run(ask()) == [b"HTTP/1.1 401 Unauthorized"] * 3


def test_a_snapshot_naming_one_host_twice_is_refused() -> None:
    """On main the reader took it, and the first update removing that host left the
    reader's document broken (KeyError on this and every later update of the stream)."""
    from gputop.hubclient.schema import SchemaError

    d = _doc("")
    d["hosts"] = d["hosts"] * 2  # type: ignore[operator]
    with pytest.raises(SchemaError, match="twice"):
        check_document(json.loads(json.dumps(d)))
    check_document(json.loads(json.dumps(_doc(""))))


def test_a_snapshot_reader_that_never_reads_is_cut_off(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Sockets that ask for the snapshot and never read it (a tiny receive buffer): on
    main the hub held each body in its write buffer for as long as the socket stayed open
    (no idle limit applies while a response is being written), so anyone on the machine
    could make it hold a copy of the document per socket. Now a write that takes no bytes
    for WRITE_TIMEOUT_S ends that connection. (The document is stood in for by 16 MB of
    JSON: the size of a large fleet's, which this test does not start.)"""
    from aiohttp import web

    import gputop.hub.server as server
    from gputop.config.load import load_config
    from gputop.hub.server import Hub, make_runner

    monkeypatch.setattr(server, "WRITE_TIMEOUT_S", 1.0)
    cfg = tmp_path / "hosts.toml"
    cfg.write_text(f'[reservations]\npath = "{tmp_path / "r.json"}"\n'
                   '[[hosts]]\nname = "here"\nlocal = true\n')
    big = json.dumps({"pad": "x" * (16 << 20)}).encode()

    async def attack() -> tuple[int, int]:
        hub = Hub(load_config(str(cfg)))
        hub.snapshot = lambda: (big, b"")  # type: ignore[method-assign]
        runner = make_runner(hub)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        stuck = []
        try:
            for _ in range(3):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.connect(("127.0.0.1", port))
                s.sendall(b"GET /api/v1/snapshot HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                stuck.append(s)
            server_side = runner.server
            assert server_side is not None
            while len(server_side.connections) < 3:
                await asyncio.sleep(0.05)
            for _ in range(300):  # (a bound: the cut comes about a second after the stall)
                if not server_side.connections:
                    break
                await asyncio.sleep(0.05)
            left = len(server_side.connections)

            def drain(s: socket.socket) -> int:
                s.settimeout(5)
                got = 0
                try:
                    while chunk := s.recv(1 << 16):
                        got += len(chunk)
                except OSError:
                    pass
                return got
            got = max([await asyncio.to_thread(drain, s) for s in stuck])
            return left, got
        finally:
            for s in stuck:
                s.close()
            hub.events.close_all()
            await runner.cleanup()

    left, got = asyncio.run(attack())
    assert left == 0
    assert got < len(big)  # cut off, not held until the reader came back for it


def test_head_of_the_snapshot_has_its_length_and_no_body(tmp_path: Path) -> None:
    """The web board asks HEAD /api/v1/snapshot: headers only (a body after them would be
    read by a kept-alive client as the start of its next answer)."""
    from aiohttp import web

    from gputop.config.load import load_config
    from gputop.hub.server import Hub, make_runner

    cfg = tmp_path / "hosts.toml"
    cfg.write_text(f'[reservations]\npath = "{tmp_path / "r.json"}"\n'
                   '[[hosts]]\nname = "here"\nlocal = true\n')

    async def ask() -> bytes:
        hub = Hub(load_config(str(cfg)))
        runner = make_runner(hub)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"HEAD /api/v1/snapshot HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Connection: close\r\n\r\n")
            data = await asyncio.wait_for(r.read(), 10)
            w.close()
            return data
        finally:
            hub.events.close_all()
            await runner.cleanup()

    head, _, body = asyncio.run(ask()).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: " in head
    assert body == b""


def test_metrics_never_repeat_a_series() -> None:
    """A host reporting one GPU (and one MIG instance) twice, and two shares of one GPU
    by one holder (a hand-written file): every series once (on main each came twice:
    duplicate samples, which Prometheus drops with an error and promtool refuses)."""
    from prometheus_client.parser import text_string_to_metric_families

    from gputop.hub.metrics import HubCounts, families, render

    inst = {"gpu_instance_id": 1, "profile": "1g.10gb", "memory_used_mib": 1,
            "memory_total_mib": 2, "processes": [], "reservation": None, "flags": []}
    gpu = {"index": 0, "uuid": "GPU-1", "name": "H100", "processes": [],
           "instances": [inst, dict(inst)], "reservation": None, "flags": [],
           "shares": [{"user": "bob", "share_mib": 10}, {"user": "bob", "share_mib": 20}]}
    doc = {"hosts": [{"name": "a", "status": "ok", "gpus": [gpu, dict(gpu)]}]}
    text = render(lambda: families(doc, {}, HubCounts(True, 0, 0, 0, 0, 0, 0, 0))).decode()
    series = [(s.name, tuple(sorted(s.labels.items())))
              for f in text_string_to_metric_families(text) for s in f.samples]
    assert len(series) == len(set(series))
    shares = [s for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "gputop_gpu_share_bytes"]
    assert [(s.labels["holder"], s.value) for s in shares] == [("bob", 30.0 * 1024 * 1024)]


def test_the_hub_bounds_its_open_connections_and_serves_again_below_the_bound(
        tmp_path: Path) -> None:
    """Sockets opened and left idle (each would live 30 s) used up the process's file
    limit, and with it the hub's own SSH connections to its hosts: beyond
    ``--max-connections`` a new connection is closed at once (and counted in /metrics);
    once one of them goes, the next client is served."""
    from aiohttp import web

    from gputop.config.load import load_config
    from gputop.hub.server import Hub, limit_connections, make_runner

    cfg = tmp_path / "hosts.toml"
    cfg.write_text(f'[reservations]\npath = "{tmp_path / "r.json"}"\n'
                   '[[hosts]]\nname = "here"\nlocal = true\n')

    async def get(port: int, path: str) -> bytes:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
                .encode())
        try:
            return await asyncio.wait_for(r.read(), 10)
        finally:
            w.close()

    async def attack() -> tuple[list[bytes], bytes, bytes, bytes]:
        hub = Hub(load_config(str(cfg)))
        runner = make_runner(hub)
        await runner.setup()
        limit_connections(hub, runner, 4)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
            await asyncio.sleep(0.2)  # (each is the server's by now)
            over = [await asyncio.wait_for(get(port, "/-/healthy"), 10) for _ in range(3)]
            idle[0][1].close()
            await asyncio.sleep(0.2)
            again = await get(port, "/-/healthy")
            idle[1][1].close()
            await asyncio.sleep(0.2)
            metrics = await get(port, "/metrics")
            for _r, w in idle[2:]:
                w.close()
            await asyncio.sleep(0.2)
            after = await get(port, "/-/healthy")
            return over, again, metrics, after
        finally:
            hub.events.close_all()
            await runner.cleanup()

    over, again, metrics, after = asyncio.run(attack())
    assert over == [b""] * 3  # closed at once, nothing answered
    assert again.startswith(b"HTTP/1.1 200") and after.startswith(b"HTTP/1.1 200")
    assert b"\ngputop_hub_connections_refused_total 3.0\n" in metrics


def test_with_a_hub_and_no_hosts_file_nothing_reserves_a_host_it_cannot_check(
        env: dict[str, str]) -> None:
    """A hub's hosts are shown to anyone, but reserving needs them in your hosts file
    (your gputop checks the job and logins there): `run` through a hosts-less hub
    reserved the hub's GPU, then crashed (StopIteration) and left it held, tied to a job
    nothing here could see end, for max_duration; `free --reserve` and `--wait` reserved
    on hosts that `reserve` and `release` refuse. Each is refused before reserving."""
    doc = _doc("")
    gpu = doc["hosts"][0]["gpus"][0]  # type: ignore[index]
    gpu.update(utilization_percent=0, memory_used_mib=0, processes=[])
    hub = FakeHub(_body(json.dumps(doc).encode()))
    try:
        r = gputop(env, "--hub", hub.url, "free")
        assert r.returncode == 0 and r.stdout == "a:0\n", r.stdout + r.stderr  # shown: yes
        for args in (("run", "--", "true"), ("free", "--reserve"), ("free", "--wait"),
                     ("free", "--share", "1M", "--reserve"), ("run", "--share", "1M", "true")):
            r = gputop(env, "--hub", hub.url, *args, timeout=30)
            assert r.returncode == 2, (args, r.stdout, r.stderr)
            assert "reserves, and each host you reserve on must be in your hosts file, " \
                "also with a hub" in r.stderr, (args, r.stderr)
            assert "Traceback" not in r.stderr
        r = gputop(env, "reservations")
        assert r.returncode == 0 and "a:0" not in r.stdout, r.stdout
    finally:
        hub.close()
