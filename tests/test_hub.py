"""The hub against the real-sshd fleet: one ``gputop serve`` for the module, read by a real
Prometheus, by raw HTTP/SSE, and by gputop's own commands (``--hub``)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from tests.support.fleet import HOSTILE_GPU_NAME, Fleet, GpuProcess, Host
from tests.support.hubs import Hub, Sse, free_port, get
from tests.support.shared_fleet import HOSTILE, need_sshd, world_readable

ADDR = "127.0.23.1"
NOTE = "<script>alert(1)</script> \"quoted\" {json} data: x"


@pytest.fixture(scope="module")
def hub_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    need_sshd()
    f = Fleet(world_readable(tmp_path_factory.mktemp("hubfleet")), [
        Host("alpha", "127.0.23.2", gpus=("h100", "rtx2080"), processes=[
            GpuProcess("gtalice", "python train.py", gpu=0, mem_mib=9000),
            GpuProcess("gtbob", HOSTILE, gpu=1, mem_mib=77),
        ]),
        Host("weird", "127.0.23.3", scenario="hostile-names", gpus=("l40s",)),
        Host("hung", "127.0.23.4", scenario="hang"),
    ]).start()
    yield f
    f.stop()


@pytest.fixture(scope="module")
def config(hub_fleet: Fleet) -> Path:
    return hub_fleet.write_config(timeout=2.0, interval=1.0)


def gputop(fleet: Fleet, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gputop", *args], capture_output=True,
                          text=True, timeout=timeout, env=fleet.env(),
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def hub(hub_fleet: Fleet, config: Path) -> Iterator[Hub]:
    r = gputop(hub_fleet, "reserve", "alpha:1", "--for", "1h", "--note", NOTE,
               "--config", str(config))
    assert r.returncode == 0, r.stderr
    h = Hub(config, hub_fleet.env(), ADDR).start(wait_ready=None)
    # Not ready while the hung host has neither answered nor timed out (2 s).
    status, _, body = get(h.url + "-/ready")
    assert status == 503 and b"waiting for" in body, (status, body)
    assert get(h.url + "-/healthy")[0] == 200
    wait_for(lambda: get(h.url + "-/ready")[0] == 200, 20, "readiness")
    yield h
    h.stop()


def wait_for(check, seconds: float = 20.0, what: str = "condition"):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} in {seconds}s")
        time.sleep(0.1)


# --- the snapshot and the security headers -------------------------------------------------


def test_snapshot_is_the_json_document(hub: Hub, hub_fleet: Fleet, config: Path,
                                       schema: dict) -> None:
    doc = hub.json("api/v1/snapshot")
    jsonschema.validate(doc, schema)
    assert doc["version"] == 5
    by = {h["name"]: h for h in doc["hosts"]}
    assert [h["name"] for h in doc["hosts"]] == ["alpha", "weird", "hung"]
    assert by["alpha"]["status"] == "ok" and len(by["alpha"]["gpus"]) == 2
    # (after its timeout a hung stream is restarted: "starting" again until the next one)
    assert by["hung"]["error"]["kind"] in ("timeout", "starting")
    # The same document `gputop --json` writes (keys and hosts; values move with time).
    direct = json.loads(gputop(hub_fleet, "--json", "--config", str(config)).stdout)
    assert set(direct) == set(doc) and [h["name"] for h in direct["hosts"]] == list(by)
    assert set(direct["hosts"][0]["gpus"][0]) == set(by["alpha"]["gpus"][0])
    assert doc["queue"] == []
    # Hostile process names, GPU names and notes are data: cleaned, JSON-encoded.
    g1 = by["alpha"]["gpus"][1]
    assert g1["reservation"]["note"] == NOTE
    assert "\x1b" not in json.dumps(doc, ensure_ascii=False)
    assert by["weird"]["gpus"][0]["name"] != HOSTILE_GPU_NAME
    assert "H100" in by["weird"]["gpus"][0]["name"]


def test_every_response_carries_the_policy(hub: Hub) -> None:
    for path in ("", "static/hub.css", "api/v1/snapshot", "metrics", "-/ready", "-/healthy",
                 "static/nope.js", "static/..%2Fserver.py", "static/../hub/server.py",
                 "nothing-here"):
        status, headers, body = get(hub.url + path)
        assert headers["Content-Security-Policy"].startswith("default-src 'self'"), path
        assert "unsafe-inline" not in headers["Content-Security-Policy"]
        assert headers["X-Content-Type-Options"] == "nosniff", path
        if path in ("static/nope.js", "static/..%2Fserver.py", "static/../hub/server.py",
                    "nothing-here"):
            assert status == 404, (path, status)
            assert b"import" not in body
        else:
            assert status == 200, (path, status)
    status, headers, body = get(hub.url)
    assert headers["Content-Type"].startswith("text/html") and b"<html" in body


def test_no_write_endpoints_and_requests_bounded(hub: Hub) -> None:
    import urllib.request

    for method in ("POST", "PUT", "DELETE", "PATCH"):
        req = urllib.request.Request(hub.url + "api/v1/snapshot", method=method, data=b"x")
        try:
            urllib.request.urlopen(req, timeout=5)
            pytest.fail(f"{method} accepted")
        except urllib.error.HTTPError as e:
            assert e.code == 405
    status, _, _ = get(hub.url + "api/v1/snapshot", headers={"X-Big": "x" * 20000})
    assert status in (400, 431)


# --- metrics: promtool and a real Prometheus -------------------------------------------------


def test_metrics_pass_promtool(hub: Hub) -> None:
    status, headers, body = get(hub.url + "metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    r = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True,
                       timeout=30)
    assert r.returncode == 0, (r.stdout + r.stderr).decode()
    text = body.decode()
    # The hostile GPU name is one escaped label value, never a line of its own.
    for line in text.splitlines():
        assert line.startswith(("#", "gputop_")), line
    assert "\x1b" not in text and "\u202e" not in text
    assert re.search(r'gputop_gpu_info\{gpu="0",host="weird",model="NVIDIA H100[^"]*evil"', text)
    assert 'gputop_host_up{host="hung"} 0.0' in text
    assert re.search(r'gputop_host_errors_total\{host="hung",kind="timeout"\} [1-9]', text)
    assert 'gputop_gpu_holder_info{' in text and 'holder="gtalice"' in text


@pytest.fixture(scope="module")
def prometheus(hub: Hub, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if shutil.which("prometheus") is None:
        pytest.skip("Debian's prometheus package is not installed")
    d = tmp_path_factory.mktemp("prom")
    port = free_port(ADDR)
    (d / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n  - job_name: gputop\n    static_configs:\n"
        f"      - targets: ['{ADDR}:{hub.port}']\n")
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={d / 'prometheus.yml'}",
         f"--storage.tsdb.path={d / 'data'}", f"--web.listen-address={ADDR}:{port}",
         "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://{ADDR}:{port}/"
    finally:
        proc.terminate()
        proc.wait(20)


def promql(base: str, query: str) -> list[dict]:
    import urllib.parse

    try:
        status, _, body = get(base + "api/v1/query?" + urllib.parse.urlencode({"query": query}),
                              timeout=5)
    except OSError:
        return []
    if status != 200:
        return []
    return json.loads(body)["data"]["result"]


def test_prometheus_scrapes_gpu_count_and_holder(prometheus: str, hub: Hub) -> None:
    count = wait_for(lambda: promql(prometheus, "count(gputop_gpu_info)"), 30,
                     "GPU count from Prometheus")
    doc = hub.json("api/v1/snapshot")
    assert count[0]["value"][1] == str(sum(len(h["gpus"]) for h in doc["hosts"]))
    assert int(count[0]["value"][1]) >= 3  # alpha's two and weird's
    held = wait_for(lambda: promql(
        prometheus, 'gputop_gpu_holder_info{kind="reservation"}'), 10, "holder")
    import os
    import pwd

    me = pwd.getpwuid(os.getuid()).pw_name
    assert [(r["metric"]["host"], r["metric"]["gpu"], r["metric"]["holder"]) for r in held] \
        == [("alpha", "1", me)]
    up = promql(prometheus, "sum(gputop_host_up)")
    assert up[0]["value"][1] == "2"


# --- the event stream -------------------------------------------------------------------------


def test_events_snapshot_then_updates_then_resume(hub: Hub, schema: dict) -> None:
    sse = Sse(hub.url)
    assert sse.resp.getheader("Content-Type") == "text/event-stream"
    assert sse.resp.getheader("Content-Security-Policy")
    events = sse.events()
    first = next(events)
    assert first["event"] == "snapshot"
    epoch, n = first["id"].rsplit("-", 1)
    doc = json.loads(first["data"])
    jsonschema.validate(doc, schema)
    ids = [int(n)]
    updates = []
    for ev in events:
        assert ev["event"] == "update"
        e, m = ev["id"].rsplit("-", 1)
        assert e == epoch and int(m) > ids[-1]
        ids.append(int(m))
        up = json.loads(ev["data"])
        assert set(up) == {"time", "hosts", "removed", "set"}
        for h in up["hosts"]:
            jsonschema.validate({"version": 5, "time": up["time"], "hosts": [h]}, schema)
        updates.append(up)
        if len(updates) == 3:
            break
    sse.close()
    # Every line on the wire is a field, a comment or an event's end: no data line of a
    # hostile name ever starts a line of its own.
    for line in sse.lines:
        assert line == "" or line.startswith(("event: ", "id: ", "data: {", ":", "retry: "))
    # Back with the last id: the missed updates only, no snapshot.
    back = Sse(hub.url, last_event_id=f"{epoch}-{ids[-2]}")
    ev = next(back.events())
    back.close()
    assert ev["event"] == "update" and ev["id"] == f"{epoch}-{ids[-1]}"
    # An id this run never gave (or a garbage one) gets a fresh snapshot.
    for bad in (f"{epoch}-999999999", "0-1", "x" * 200, f"{epoch}-{ids[-1]}\\ninjected"):
        again = Sse(hub.url, last_event_id=bad)
        assert next(again.events())["event"] == "snapshot", bad
        again.close()
    status, _, _ = get(hub.url + "api/v1/events", headers={"Last-Event-ID": "\x00"})
    assert status == 400


def test_a_change_on_a_host_reaches_a_subscriber(hub: Hub, hub_fleet: Fleet) -> None:
    sse = Sse(hub.url)
    events = sse.events()
    next(events)
    p = GpuProcess("gtbob", "python joined.py", gpu=0, mem_mib=500)
    alpha_host = hub_fleet.hosts["alpha"]
    alpha_host.processes.append(p)
    hub_fleet.start_process(p)
    hub_fleet.set_scenario(alpha_host, "ok")
    started = time.monotonic()
    try:
        for ev in events:
            up = json.loads(ev["data"])
            alpha = [h for h in up["hosts"] if h["name"] == "alpha"]
            if alpha and any(q["pid"] == p.pid for q in alpha[0]["gpus"][0]["processes"]):
                break
            assert time.monotonic() - started < 15, "the new process never showed"
    finally:
        sse.close()
        assert p.popen is not None
        p.popen.kill()
        alpha_host.processes.remove(p)
        hub_fleet.set_scenario(alpha_host, "ok")


def test_a_waiter_reaches_the_stream_and_the_metrics(hub: Hub, config: Path) -> None:
    """The queue is in the document (schema 3): a waiter joining is one ``update`` whose
    ``set`` carries the whole new queue, and ``/metrics`` counts it; leaving, the same."""
    from gputop.config.load import load_config
    from gputop.reservations.queue import Queue, Request
    from gputop.reservations.store import Store

    sse = Sse(hub.url)
    events = sse.events()
    next(events)
    q = Queue(Store(load_config(str(config)).reservations.path),
              Request(2, 0, ("alpha",), want="--host alpha"))
    q.join()
    try:
        for ev in events:
            moved = json.loads(ev["data"])["set"]
            if "queue" in moved:
                assert [w["count"] for w in moved["queue"]] == [2]
                assert moved["queue"][0]["want"] == "--host alpha"
                break
        text = get(hub.url + "metrics")[2].decode()
        assert "gputop_queue_waiters 1.0" in text
        assert re.search(r'gputop_queue_waiter_gpus\{[^}]*position="1"[^}]*\} 2\.0', text)
    finally:
        q.leave()
    for ev in events:
        moved = json.loads(ev["data"])["set"]
        if "queue" in moved:
            assert moved["queue"] == []
            break
    sse.close()


def test_subscribers_are_bounded(hub_fleet: Fleet, config: Path, tmp_path: Path) -> None:
    """A second hub with room for one stream: the second is refused (503), the first
    goes on; it is not this module's main hub, so the other tests keep theirs."""
    cfg = tmp_path / "one.toml"
    cfg.write_text(config.read_text().replace('[[hosts]]\nname = "weird"\n\n', "")
                   .replace('[[hosts]]\nname = "hung"\n\n', ""))
    h = Hub(cfg, hub_fleet.env(), ADDR, extra=("--max-subscribers", "1")).start()
    try:
        one = Sse(h.url)
        assert next(one.events())["event"] == "snapshot"
        status, headers, _ = get(h.url + "api/v1/events")
        assert status == 503 and headers["Content-Security-Policy"]
        one.close()
    finally:
        h.stop()


# --- gputop reading a hub ---------------------------------------------------------------------


def test_commands_read_the_hub_and_a_hung_host_costs_nothing(hub: Hub, hub_fleet: Fleet,
                                                            config: Path,
                                                            schema: dict) -> None:
    """``--json``, ``--once`` and ``free`` through the hub: no SSH (the hub's own hosts
    only: a config without them), and the hung host does not slow them down."""
    bare = config.parent / "client.toml"
    bare.write_text(f'[hub]\nurl = "{hub.url}"\n[reservations]\n'
                    f'path = "{config.parent / "reservations.json"}"\n')
    for args in (("--json",), ("--once",), ("free", "--json")):
        t = time.monotonic()
        r = gputop(hub_fleet, *args, "--config", str(bare))
        took = time.monotonic() - t
        assert r.returncode == 0 if args[0] != "free" else r.returncode in (0, 1), r.stderr
        # Python's own start-up is most of it; a hung host would have cost its timeout (2 s).
        assert took < 1.5 + 2.0, (args, took)
        if args == ("--json",):
            doc = json.loads(r.stdout)
            jsonschema.validate(doc, schema)
            assert [h["name"] for h in doc["hosts"]] == ["alpha", "weird", "hung"]
            assert doc["hosts"][0]["gpus"][1]["reservation"]["note"] == NOTE
        if args == ("--once",):
            assert "alpha" in r.stdout and "hung" in r.stdout
    # --hub on the command line, with the fleet's own config (hosts named there).
    r = gputop(hub_fleet, "--json", "--config", str(config), "--hub", hub.url)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["hosts"][0]["status"] == "ok"


def test_a_hub_that_is_down_is_one_classified_error(hub_fleet: Fleet, config: Path) -> None:
    port = free_port(ADDR)
    for args in (("--json",), ("--once",), ("free",)):
        t = time.monotonic()
        r = gputop(hub_fleet, *args, "--config", str(config), "--hub", f"http://{ADDR}:{port}/")
        assert r.returncode == 4, (args, r.returncode, r.stderr)
        assert f"hub http://{ADDR}:{port}/: unreachable" in r.stderr
        assert time.monotonic() - t < 10
    # fallback = "direct": the hosts are polled instead, and it says so.
    fb = config.parent / "fallback.toml"
    fb.write_text(config.read_text() + f'\n[hub]\nurl = "http://{ADDR}:{port}/"\n'
                  'fallback = "direct"\n')
    r = gputop(hub_fleet, "--json", "--config", str(fb))
    assert r.returncode == 0, r.stderr
    assert "polling the hosts directly" in r.stderr
    assert json.loads(r.stdout)["hosts"][0]["status"] == "ok"


def _http(body: bytes, status: str = "200 OK", length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return f"HTTP/1.1 {status}\r\nContent-Length: {n}\r\n\r\n".encode() + body


@pytest.mark.parametrize("answer", [
    _http(b"nope!"),
    _http(b'{"version": 5, "time": NaN, "hosts": []}'),
    _http(b'{"version": 5, "time": "2026-01-01T00:00:00Z", "hosts": [1]}'),
    _http(b'{"version": 5, "time": "2026-01-01T00:00:00Z", "hosts": [], "evil": 1}'),
    _http(b"[" * 100000),
    _http(b"{", length=99999999999),
    _http(b"", "401 Unauthorized"),
    b"SSH-2.0-OpenSSH_9.2\r\n",  # not HTTP at all
    b"",  # accepts and never answers
], ids=["not-json", "nan", "bad-host", "unknown-key", "deep", "huge", "401", "not-http",
        "silent"])
def test_a_hub_answering_garbage_is_one_classified_error(hub_fleet: Fleet, config: Path,
                                                        answer: bytes) -> None:
    """A hostile (or broken) hub: a listener that sends fixed bytes, nothing else."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind((ADDR, 0))
    srv.listen(4)
    port = srv.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        conns = []
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            conns.append(c)
            c.settimeout(2)
            try:
                c.recv(65536)
                if answer:
                    c.sendall(answer)
                    c.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        for c in conns:
            c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        started = time.monotonic()
        r = gputop(hub_fleet, "--json", "--config", str(config), "--timeout", "1",
                   "--hub", f"http://{ADDR}:{port}/")
        assert r.returncode == 4, (r.returncode, r.stderr)
        kind = {b"": "timeout"}.get(answer, "auth" if b"401" in answer[:20] else "parse")
        assert f": {kind}: " in r.stderr, r.stderr
        assert r.stdout == ""
        assert time.monotonic() - started < 10
    finally:
        stop.set()
        t.join(5)
        srv.close()


def test_watch_and_sse_survive_a_hub_restart(hub_fleet: Fleet, config: Path,
                                             tmp_path: Path) -> None:
    """A hub killed mid-stream: ``--json --watch --hub`` says so in the document and goes
    on; the restarted hub (new epoch) answers an old ``Last-Event-ID`` with a snapshot."""
    cfg = tmp_path / "alpha.toml"
    cfg.write_text(config.read_text().replace('[[hosts]]\nname = "weird"\n\n', "")
                   .replace('[[hosts]]\nname = "hung"\n\n', ""))
    h = Hub(cfg, hub_fleet.env(), ADDR).start()
    watch = subprocess.Popen(
        [sys.executable, "-m", "gputop", "--json", "--watch", "--config", str(cfg),
         "--hub", h.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=hub_fleet.env())
    try:
        from tests.test_cli import read_lines

        first = json.loads(read_lines(watch, 1, 20)[0])
        assert first["hosts"][0]["status"] == "ok"
        sse = Sse(h.url)
        old = next(sse.events())["id"]
        h.stop(signal.SIGKILL)  # mid-stream
        assert list(sse.events()) == []  # the stream ends; it does not hang
        down = wait_for(lambda: next((d for d in (json.loads(x) for x in
                                                  read_lines(watch, 1, 20))
                                      if d["hosts"][0]["status"] == "error"), None), 20,
                        "a document saying the hub is down")
        assert down["hosts"][0]["error"]["kind"] == "unreachable"
        assert h.url in down["hosts"][0]["error"]["message"]
        h.start()
        back = Sse(h.url, last_event_id=old)
        ev = next(back.events())
        back.close()
        assert ev["event"] == "snapshot" and ev["id"].split("-")[0] != old.split("-")[0]
        wait_for(lambda: json.loads(read_lines(watch, 1, 20)[0])["hosts"][0]["status"]
                 == "ok", 20, "the watch back on the restarted hub")
        assert watch.poll() is None
    finally:
        watch.terminate()
        watch.wait(10)
        h.stop()


async def test_the_board_reads_a_hub_and_recovers_when_it_is_killed(
        hub_fleet: Fleet, config: Path, tmp_path: Path) -> None:
    """The real board (Textual's pilot) on ``[hub] url``: the hub's hosts, no SSH; the hub
    killed mid-stream is every row's classified error and a summary-bar banner, and the
    restarted hub's data comes back by itself."""
    from gputop.config.load import load_config
    from gputop.ui.app import GputopApp
    from gputop.ui.widgets import SummaryBar

    cfg = tmp_path / "alpha.toml"
    cfg.write_text(config.read_text().replace('[[hosts]]\nname = "weird"\n\n', "")
                   .replace('[[hosts]]\nname = "hung"\n\n', ""))
    h = Hub(cfg, hub_fleet.env(), ADDR).start()
    reader = tmp_path / "reader.toml"
    reader.write_text(f'[defaults]\ninterval = 1\ntimeout = 2\n[hub]\nurl = "{h.url}"\n'
                      f'[reservations]\npath = "{tmp_path / "r.json"}"\n')
    app = GputopApp(load_config(str(reader)), user="ann")
    try:
        async with app.run_test(size=(120, 30)) as pilot:
            async def until(check, what: str, seconds: float = 20) -> None:  # type: ignore[no-untyped-def]
                for _ in range(int(seconds / 0.05)):
                    if check():
                        return
                    await pilot.pause(0.05)
                pytest.fail(f"the board never showed {what}")

            def alpha():  # type: ignore[no-untyped-def]
                return app.model.snapshots.get("alpha")

            await until(lambda: alpha() is not None and len(alpha().gpus) == 2, "alpha")
            h.stop(signal.SIGKILL)
            await until(lambda: alpha().error is not None
                        and alpha().error.kind == "unreachable", "the hub down")
            app.render_board()
            await pilot.pause()
            assert "hub unreachable" in str(app.query_one(SummaryBar).render())
            assert h.url in alpha().error.message
            # `c` cannot reconnect a host the hub polls: it says it asks the hub again.
            from gputop.ui.table import BoardTable

            table = app.query_one(BoardTable)
            table.move_cursor(row=table.get_row_index("alpha"))
            notes: list[str] = []
            app.notify = lambda message, **_kw: notes.append(str(message))  # type: ignore[method-assign]
            await pilot.press("c")
            assert notes == ["the hub polls alpha: asking the hub again now"], notes
            await pilot.press("enter")
            await pilot.pause()
            pane = str(app.query_one("#detail-head").render())
            assert "c asks the hub again now" in pane and "reconnects now" not in pane, pane
            await pilot.press("escape")
            h.start()
            await until(lambda: alpha().error is None and len(alpha().gpus) == 2,
                        "the hub back")
            app.render_board()
            await pilot.pause()
            assert "hub " not in str(app.query_one(SummaryBar).render())
    finally:
        h.stop()


def test_a_waiter_through_the_hub_is_granted_when_a_gpu_frees(hub: Hub, hub_fleet: Fleet,
                                                              config: Path) -> None:
    """``free --wait --hub``: the waiter reads the hub's stream (no SSH of its own) and is
    granted the GPU once its last process is gone (alpha:1: idle but for gtbob's job once
    the module's reservation of it is released). Last in the module: it ends a job."""
    r = gputop(hub_fleet, "release", "alpha:1", "--config", str(config))
    assert r.returncode == 0, r.stderr
    alpha = hub_fleet.hosts["alpha"]
    job = next(p for p in alpha.processes if p.gpu == 1)
    waiter = subprocess.Popen(
        [sys.executable, "-m", "gputop", "free", "--count", "1", "--host", "alpha", "--wait",
         "--max-wait", "60s", "--json", "--config", str(config), "--hub", hub.url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=hub_fleet.env())
    try:
        assert waiter.stderr is not None
        line = waiter.stderr.readline()
        assert "position 1" in line, line
        assert job.popen is not None
        job.popen.kill()
        alpha.processes.remove(job)
        hub_fleet.set_scenario(alpha, "ok")
        out, err = waiter.communicate(timeout=60)
        assert waiter.returncode == 0, err
        got = json.loads(out)["free"]
        assert [(g["host"], g["gpu"]) for g in got] == [("alpha", 1)]
    finally:
        if waiter.poll() is None:
            waiter.kill()
