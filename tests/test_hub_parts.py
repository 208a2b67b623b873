"""The hub's parts on their own: the event log's window and its slow subscribers, the
reader's schema check, the metric families and the shipped dashboard, [hub] config, the
token. Servers here are real (aiohttp on loopback); the hub's one host is the local
machine through NVML, which this machine does not have: that host is a real ``no-nvml``
error, enough for what is checked here."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gputop.config.load import load_config
from gputop.config.values import ConfigError
from gputop.hub.events import EventLog, frame
from gputop.hub.metrics import HostCounts, HubCounts, families, render
from gputop.hub.server import Hub, listen_warning
from gputop.hubclient.client import check_document, check_update, parse_json
from gputop.hubclient.schema import SchemaError
from tests.support.hubs import Hub as HubProcess
from tests.support.hubs import get

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "gputop" / "hub" / "deploy"


def local_config(tmp_path: Path, extra: str = "") -> Path:
    cfg = tmp_path / "hosts.toml"
    cfg.write_text(f'[defaults]\ninterval = 0.5\ntimeout = 1\n[reservations]\npath = '
                   f'"{tmp_path / "r.json"}"\n{extra}\n[[hosts]]\nname = "here"\nlocal = true\n')
    return cfg


# --- the event log ---------------------------------------------------------------------------


def test_event_ids_window_and_epochs() -> None:
    log = EventLog(retain=3, epoch="abc")
    assert log.missed("abc-0") == [] and log.missed(None) is None
    for i in range(5):
        log.publish(json.dumps({"n": i}))
    assert log.event_id() == "abc-5"
    assert [f.split(b"\n")[1] for f in log.missed("abc-3") or []] == [b"id: abc-4", b"id: abc-5"]
    assert log.missed("abc-2") is not None  # 3, 4, 5 retained
    assert log.missed("abc-1") is None  # 2 fell out of the window: a fresh snapshot
    assert log.missed("abc-6") is None and log.missed("abd-5") is None
    assert log.missed("abc-5\nevent: x") is None and log.missed("x" * 100) is None
    assert EventLog().epoch != EventLog().epoch  # two runs never share ids
    with pytest.raises(ValueError):
        frame("update", "abc-1", '{"a": 1}\ndata: forged')


def test_the_retained_window_is_bounded_in_bytes_too() -> None:
    """256 events of a 1,000-host fleet's updates (and their patches) were over a gigabyte:
    the window also ends where it holds ``retain_bytes``, the newest event kept whatever
    its size; a resume from before it gets a fresh snapshot, as from before the count."""
    log = EventLog(retain=256, retain_bytes=10_000, epoch="e")
    for i in range(40):
        log.publish(json.dumps({"n": i, "pad": "x" * 900}), json.dumps({"p": i}))
    assert log.retained_bytes <= 10_000 and len(log.retained) < 15
    assert log.retained_bytes == sum(len(u) + len(p) for _n, u, p in log.retained)
    first = log.retained[0][0]
    assert log.missed(f"e-{first - 1}") is not None  # the window's first event onwards
    assert log.missed(f"e-{first - 2}") is None  # from before it: a fresh snapshot
    log.publish(json.dumps({"pad": "y" * 50_000}))  # one event over the bound: kept alone
    assert len(log.retained) == 1 and log.missed(f"e-{log.seq - 1}") is not None


def test_a_subscriber_that_falls_behind_is_dropped_alone() -> None:
    log = EventLog(backlog=4)
    killed = []
    slow = log.subscribe(lambda: killed.append("slow"))
    quick = log.subscribe(lambda: killed.append("quick"))
    assert slow is not None and quick is not None
    for i in range(10):
        log.publish(str(i))
        quick.take()
    assert killed == ["slow"] and slow.dropped and not slow.pending
    assert log.subscribers == {quick} and log.dropped == 1
    log2 = EventLog(max_subscribers=1)
    assert log2.subscribe(lambda: None) is not None
    assert log2.subscribe(lambda: None) is None and log2.refused == 1


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[Hub, int]]:
    from aiohttp import web

    config = load_config(str(local_config(tmp_path)))
    hub = Hub(config, backlog=8)
    runner = web.AppRunner(hub.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield hub, port
    finally:
        hub.events.close_all()
        await runner.cleanup()


async def test_a_stream_nobody_reads_is_dropped_not_buffered(served: tuple[Hub, int]) -> None:
    """A real socket that asks for the stream and never reads: once the kernel's buffers
    are full the hub's backlog fills, and that subscriber is cut off; a reader that keeps
    up is not."""
    hub, port = served
    loop = asyncio.get_running_loop()
    stuck = socket.create_connection(("127.0.0.1", port))
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.sendall(b"GET /api/v1/events HTTP/1.1\r\nHost: x\r\n\r\n")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /api/v1/events HTTP/1.1\r\nHost: x\r\n\r\n")
    while len(hub.events.subscribers) < 2:
        await asyncio.sleep(0.01)
    got = 0

    async def read() -> None:
        nonlocal got
        while chunk := await reader.read(1 << 20):
            got += len(chunk)

    reading = loop.create_task(read())
    big = json.dumps({"time": "x", "hosts": [], "removed": [], "set": {"pad": "y" * 65536}})
    for _ in range(400):  # 26 MB: more than any socket buffers
        hub.events.publish(big)
        await asyncio.sleep(0)
        if hub.events.dropped:
            break
    for _ in range(200):
        if hub.events.dropped:
            break
        await asyncio.sleep(0.01)
    assert hub.events.dropped == 1
    assert len(hub.events.subscribers) == 1  # the reader is still subscribed
    hub.events.publish('{"last": 1}')
    await asyncio.sleep(0.2)
    assert got > 1_000_000
    reading.cancel()
    writer.close()
    stuck.close()


# --- the reader's check of a hub's answers ---------------------------------------------------


def _doc() -> dict:
    gpu = {"index": 0, "uuid": "GPU-1", "name": "H100", "utilization_percent": 5,
           "memory_used_mib": 1, "memory_total_mib": 2, "temperature_c": None,
           "power_draw_w": 1.5, "processes": [{"pid": 1, "user": "u", "command":
                                                "evil \x1b]0;x\x07 \u202e", "gpu_memory_mib": 1}],
           "instances": [], "reservation": None, "flags": []}
    return {"version": 5, "time": "2026-01-01T00:00:00Z", "hosts": [
        {"name": "a", "status": "ok", "error": None, "gpus": [gpu]}], "queue": []}


def test_the_reader_checks_and_cleans_what_a_hub_sends() -> None:
    doc = check_document(_doc())
    assert doc["hosts"][0]["gpus"][0]["processes"][0]["command"] == "evil  "
    for bad in ({**_doc(), "version": 2}, {**_doc(), "extra": 1}, {**_doc(), "time": "now"},
                {**_doc(), "hosts": [{"name": "a"}]}, [], "x"):
        with pytest.raises(SchemaError):
            check_document(bad)
    d = _doc()
    d["hosts"][0]["gpus"][0]["index"] = True  # a boolean is not an integer
    with pytest.raises(SchemaError):
        check_document(d)
    for raw in (b"[" * 10000 + b"]" * 10000, b'{"a": NaN}', b'{"a": Infinity}', b"\xff"):
        with pytest.raises(SchemaError):
            check_document(parse_json(raw))
    up = {"time": "2026-01-01T00:00:00Z", "hosts": [], "removed": ["a"],
          "set": {"queue": [], "reservations_error": None}}
    assert check_update(up)["set"] == {"queue": [], "reservations_error": None}
    for bad in ({**up, "set": {"version": 9}}, {**up, "set": {"hosts": []}},
                {**up, "extra": 1}, {**up, "removed": [1]}):
        with pytest.raises(SchemaError):
            check_update(bad)


# --- metrics and what ships with them -----------------------------------------------------


def exported_names() -> set[str]:
    doc = _doc()
    doc["queue"] = [{"id": "w1", "user": "u", "count": 2}]
    text = render(lambda: families(doc, {"a": HostCounts(3, {"timeout": 1}, 0.5)},
                                   HubCounts(True, 1.0, 1, 1, 0.1, 0, 0, 0))).decode()
    # Every family's name as its samples carry it (families without samples here still
    # say their TYPE: the text format names it as its samples are named).
    return ({m.group(1) for m in re.finditer(r"^# TYPE (\S+) \S+$", text, re.M)}
            | {m.group(1) for m in re.finditer(r"^([a-z_:][a-z0-9_:]*)[{ ]", text, re.M)})


def test_no_family_uses_a_label_prometheus_sets_on_the_target() -> None:
    """`instance` and `job` are the scrape target's: a series carrying its own arrives as
    `exported_instance` / `exported_job` (a MIG instance's label is `mig_instance`)."""
    for fam in families(_doc(), {"a": HostCounts(3, {"timeout": 1}, 0.5)},
                        HubCounts(True, 1.0, 1, 1, 0.1, 0, 0, 0)):
        for sample in fam.samples:
            assert not {"instance", "job"} & set(sample.labels), (fam.name, sample.labels)
    from gputop.hub import metrics

    assert "mig_instance" in metrics.MIG_LABELS and "instance" not in metrics.MIG_LABELS


def test_null_is_left_out_never_zero() -> None:
    text = render(lambda: families(_doc(), {}, HubCounts(False, 0, 0, 0, 0, 0, 0, 0))).decode()
    assert "gputop_gpu_temperature_celsius{" not in text  # null: no sample
    assert re.search(r'gputop_gpu_power_watts\{[^}]*\} 1\.5', text)
    assert re.search(r'gputop_gpu_utilization_ratio\{[^}]*\} 0\.05', text)


def test_the_dashboard_asks_only_for_exported_metrics() -> None:
    names = exported_names()
    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    used = {m for e in exprs for m in re.findall(r"\bgputop_[a-z0-9_]+", e)}
    assert used and used <= names, sorted(used - names)
    assert len(exprs) >= 15


def test_the_scrape_config_is_valid_prometheus(tmp_path: Path) -> None:
    if subprocess.run(["which", "promtool"], capture_output=True).returncode:
        pytest.skip("promtool (Debian's prometheus package) is not installed")
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text((DEPLOY / "prometheus-scrape.yml").read_text())
    r = subprocess.run(["promtool", "check", "config", str(cfg)], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    unit = (DEPLOY / "gputop-hub.service").read_text()
    assert "ExecStart=%h/.local/bin/gputop serve" in unit
    # (a stop is SIGTERM and the hub's exit 143: clean, or every stop reads "failed")
    assert "\nSuccessExitStatus=143\n" in unit


# --- [hub] in the config, the token, listening ------------------------------------------------


@pytest.mark.parametrize(("extra", "key"), [
    ('[hub]\nurl = "ftp://x/"\n', "hub.url"),
    ('[hub]\nurl = "http://user:pw@x:1/"\n', "hub.url"),
    ('[hub]\nurl = "http://x:99999/"\n', "hub.url"),
    ('[hub]\nfallback = "sometimes"\n', "hub.fallback"),
    ('[hub]\nlisten = "everywhere"\n', "hub.listen"),
    ('[hub]\ntoken = "inline"\n', "hub.token"),
    ('[hub]\ntoken_file = ""\n', "hub.token_file"),
    ('[hub]\nretain_mb = 0\n', "hub.retain_mb"),
    ('[hub]\nretain_mb = "64"\n', "hub.retain_mb"),
])
def test_hub_config_mistakes_name_file_and_key(tmp_path: Path, extra: str, key: str) -> None:
    cfg = local_config(tmp_path, extra)
    with pytest.raises(ConfigError) as e:
        load_config(str(cfg))
    assert str(cfg) in str(e.value) and key in str(e.value)
    r = subprocess.run([sys.executable, "-m", "gputop", "--json", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and key in r.stderr


def test_a_reader_needs_no_hosts_only_the_hub(tmp_path: Path) -> None:
    cfg = tmp_path / "reader.toml"
    cfg.write_text('[hub]\nurl = "http://127.0.0.1:9/"\n')
    assert load_config(str(cfg)).hosts == ()
    cfg.write_text('[hub]\nurl = "http://127.0.0.1:9/"\nfallback = "direct"\n')
    with pytest.raises(ConfigError, match="hosts"):
        load_config(str(cfg))


async def test_a_hub_reader_says_when_it_fell_back_to_polling_directly(tmp_path: Path) -> None:
    """The board asks ``direct`` whether ``c`` reconnects a host itself or only asks the
    hub again, and shows ``error`` in its bar: both public on the hub's reader."""
    from gputop.hubclient.poller import HubPoller

    cfg = tmp_path / "reader.toml"
    cfg.write_text('[hub]\nurl = "http://127.0.0.1:9/"\nfallback = "direct"\n'
                   '[[hosts]]\nname = "here"\nlocal = true\n')
    poller = HubPoller(load_config(str(cfg)))
    assert not poller.direct and poller.error is None
    try:
        fleet = await poller.snapshot()  # nothing listens on port 9: polled directly
    finally:
        await poller.aclose()
    assert poller.direct and poller.error is not None
    assert poller.error.kind == "unreachable"
    assert [h.name for h in fleet.hosts] == ["here"]


def test_the_token_is_required_and_sent(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    cfg = local_config(tmp_path, f'[hub]\ntoken_file = "{token}"\n')
    hub = HubProcess(cfg, {**__import__("os").environ}).start(wait_ready=None)
    try:
        for path in ("api/v1/snapshot", "api/v1/events", "metrics"):
            status, headers, _ = get(hub.url + path)
            assert status == 401 and headers["WWW-Authenticate"] == "Bearer", path
            status, _, _ = get(hub.url + path, {"Authorization": "Bearer wrong"})
            assert status == 401
        status, _, _ = get(hub.url + "metrics", {"Authorization": "Bearer s3cret-token"})
        assert status == 200
        assert get(hub.url + "-/healthy")[0] == 200  # liveness needs no token
        reader = tmp_path / "reader.toml"
        reader.write_text(f'[hub]\nurl = "{hub.url}"\ntoken_file = "{token}"\n')
        r = subprocess.run([sys.executable, "-m", "gputop", "--json", "--config", str(reader)],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 3, r.stderr  # read; its one host (no NVML here) is down
        assert json.loads(r.stdout)["hosts"][0]["name"] == "here"
        reader.write_text(f'[hub]\nurl = "{hub.url}"\n')
        r = subprocess.run([sys.executable, "-m", "gputop", "--json", "--config", str(reader)],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 4 and ": auth: " in r.stderr
    finally:
        hub.stop()


def test_listening_beyond_loopback_says_so(tmp_path: Path) -> None:
    """(Worked out, not bound: tests listen on loopback only.)"""
    for host in ("0.0.0.0", "::", "10.1.2.3", "gpu-hub.example.org"):
        said = listen_warning(host, has_token=False)
        assert said and "beyond this machine" in said and "token_file" in said
        assert "token_file" not in (listen_warning(host, has_token=True) or "x token_file")
    for host in ("127.0.0.1", "127.0.23.1", "::1", "localhost"):
        assert listen_warning(host, has_token=False) is None
    hub = HubProcess(local_config(tmp_path), {**__import__("os").environ}).start(
        wait_ready=None)
    try:
        assert "serving 1 host(s) on http://127.0.0.1:" in hub.stderr()
        assert "beyond" not in hub.stderr()
    finally:
        hub.stop()


def test_serve_mistakes_are_one_line_and_exit_2(tmp_path: Path) -> None:
    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gputop", "serve", *args],
                              capture_output=True, text=True, timeout=30)

    reader = tmp_path / "reader.toml"
    reader.write_text('[hub]\nurl = "http://127.0.0.1:9/"\n')
    r = serve("--config", str(reader))
    assert r.returncode == 2 and "hosts" in r.stderr and str(reader) in r.stderr
    cfg = local_config(tmp_path)
    r = serve("--config", str(cfg), "--listen", "nowhere")
    assert r.returncode == 2 and "HOST:PORT" in r.stderr
    r = serve("--config", str(cfg), "--max-subscribers", "0")
    assert r.returncode == 2 and "--max-subscribers" in r.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = serve("--config", str(cfg), "--listen", f"127.0.0.1:{port}")
    assert r.returncode == 2 and "cannot listen" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_broken_shared_file_is_reported_and_read_again_only_when_it_changes(
        tmp_path: Path) -> None:
    """The collector reads the shared file (off its loop) only when it changed, never in
    a fold (up to ten a second); a broken one is ``reservations_error`` (and ``set`` in an
    update), and its mending clears it. No poller runs: the host is its placeholder."""
    from gputop.hub.collector import Collector
    from gputop.hub.metrics import HubCounts, families, render

    config = load_config(str(local_config(tmp_path)))
    c = Collector(config)
    updates: list[dict] = []
    c.on_update = lambda text, _patch: updates.append(json.loads(text))
    reads = 0
    real = c.store.read

    def counted():  # type: ignore[no-untyped-def]
        nonlocal reads
        reads += 1
        return real()

    c.store.read = counted  # type: ignore[method-assign]
    path = config.reservations.path
    path.write_text('{"version": 1, "reservations": [{"id": 1e999}], "events": []}')
    assert c.refresh_store()
    c.fold()
    assert "reservations_error" in c.document() and "queue" not in c.document()
    assert "reservations" not in c.document()
    assert updates[-1]["set"]["reservations_error"] == c.document()["reservations_error"]
    assert updates[-1]["set"]["queue"] is None and updates[-1]["set"]["reservations"] is None
    text = render(lambda: families(c.document(), {}, HubCounts(0, 0, 0, 0, 0, 0, 0, 0)))
    assert b"gputop_reservations_file_ok 0.0" in text
    for _ in range(5):
        assert not c.refresh_store()
        c.fold()
    assert reads == 1  # unchanged: not read again (and a fold reads nothing)
    path.write_text('{"version": 1, "reservations": [], "events": []}')
    assert c.refresh_store()
    c.fold()
    assert reads == 2 and "reservations_error" not in c.document()
    assert updates[-1]["set"] == {"queue": [], "reservations": [], "reservations_error": None}


async def test_a_reader_resumes_a_dropped_stream_where_it_broke(
        served: tuple[Hub, int]) -> None:
    """gputop's reader (``HubPoller``) on a real hub whose streams are all ended while it
    keeps running: the host shows the hub's error, then, back within the window, the
    missed update (no second snapshot), the host's data first restored."""

    from gputop.hubclient.poller import HubPoller
    from gputop.model import GpuInfo, HostSnapshot

    hub, port = served
    poller = HubPoller(hub.config.with_hub(url=f"http://127.0.0.1:{port}/"))
    got: list[HostSnapshot] = []

    async def read() -> None:
        async for h in poller.updates():
            got.append(h)

    async def until(check, what: str) -> None:  # type: ignore[no-untyped-def]
        for _ in range(400):
            if got and check(got[-1]):
                return
            await asyncio.sleep(0.025)
        pytest.fail(f"never {what}: {got[-3:]}")

    def answer(util: int) -> None:
        hub.collector.observe(HostSnapshot("here", source="nvml", gpus=(
            GpuInfo(index=0, uuid="GPU-1", name="T", utilization_percent=util),)))
        hub.collector.fold()

    task = asyncio.get_running_loop().create_task(read())
    try:
        await until(lambda h: h.name == "here", "the snapshot")
        answer(10)
        await until(lambda h: h.gpus and h.gpus[0].utilization_percent == 10, "an update")
        hub.events.close_all()
        await until(lambda h: h.error is not None and h.error.kind == "unreachable",
                    "the hub's error")
        answer(50)  # while the reader is away
        await until(lambda h: h.gpus and h.gpus[0].utilization_percent == 50, "the resume")
        assert poller.error is None and poller.connects == 1  # resumed, not a new snapshot
        restored = [h for h in got if h.error is None and h.gpus
                    and h.gpus[0].utilization_percent == 10]
        assert len(restored) == 2  # the update, and again right after the resume
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await poller.aclose()


def test_a_loopback_hub_answers_to_loopback_names_only(tmp_path: Path) -> None:
    """DNS rebinding: a page on evil.example whose name now points at 127.0.0.1 sends
    ``Host: evil.example``; a hub on loopback refuses it (421), whatever the route."""
    hub = HubProcess(local_config(tmp_path), {**__import__("os").environ}).start(
        wait_ready=None)
    try:
        for host in ("evil.example", "evil.example:80", "10.0.0.1", ""):
            for path in ("", "api/v1/snapshot", "metrics", "-/healthy"):
                status, headers, _ = get(hub.url + path, {"Host": host})
                assert status == 421, (host, path, status)
                assert headers["Content-Security-Policy"]
        for host in (f"127.0.0.1:{hub.port}", "localhost", f"localhost:{hub.port}",
                     "[::1]:1", "127.9.9.9"):
            assert get(hub.url + "api/v1/snapshot", {"Host": host})[0] == 200, host
    finally:
        hub.stop()


def test_every_waiter_field_is_in_the_schema(schema: dict) -> None:
    """The document's queue is ``Waiter.to_dict``: a field added there (as ``sees`` and
    ``share_mib`` were) must be added to the schema's closed ``waiter``, or every hub
    reader refuses the document as ``parse``. A waiter with every field set checks out."""
    import dataclasses
    from datetime import timedelta

    import jsonschema

    from gputop.model import utcnow
    from gputop.reservations.records import Waiter

    now = utcnow()
    w = Waiter("w1", "ann", "laptop", 2, now, now + timedelta(seconds=60), min_free_mib=1,
               hosts=("a",), want="--host a", one_host=True, share_mib=1024, sees=("a",))
    unset = [f.name for f in dataclasses.fields(Waiter)
             if getattr(w, f.name) == f.default and f.default is not None]
    assert not unset, f"set these in the test too: {unset}"
    doc = _doc()
    doc["queue"] = [w.to_dict()]
    jsonschema.validate(doc, schema)
    assert check_document(doc)["queue"] == [w.to_dict()]


@pytest.mark.parametrize(("text", "said"), [
    ("127.0.0.1:99999", "'127.0.0.1:99999': port 99999 is out of range (1 to 65535)"),
    ("127.0.0.1:0", "'127.0.0.1:0': port 0 is out of range (1 to 65535)"),
    ("nope", "'nope': expected HOST:PORT, e.g. 127.0.0.1:9847"),
    (":9847", "':9847': expected HOST:PORT, e.g. 127.0.0.1:9847"),
])
def test_listen_says_what_is_wrong_with_it(text: str, said: str) -> None:
    """One rule for --listen and [hub] listen, and a port out of range is said as one
    (it was "expected HOST:PORT" to someone who gave HOST:PORT)."""
    from gputop.config.values import listen_problem
    from gputop.hub.server import ListenError, parse_listen

    assert listen_problem(text) == said
    with pytest.raises(ListenError) as e:
        parse_listen(text)
    assert str(e.value) == f"--listen {said}"
    assert parse_listen("[::1]:9847") == ("::1", 9847)


def test_a_down_hosts_reservations_are_in_the_document_and_the_metrics(
        tmp_path: Path) -> None:
    """A host that is down reports no GPUs, so no GPU carried its reservations: the web
    board's "who holds what", the snapshot and /metrics said nobody held anything there
    while `gputop reservations` listed them. The document's top-level ``reservations``
    lists every active one."""
    from gputop.hub.collector import Collector
    from gputop.hubclient.schema import check
    from gputop.reservations.ops import Target, reserve
    from gputop.reservations.store import Store

    config = load_config(str(local_config(tmp_path)))
    store = Store(config.reservations.path)
    made = reserve(store, [Target("here", 3)], seconds=3600, max_seconds=7200, user="eve")
    reserve(store, [Target("gone", 0)], seconds=3600, max_seconds=7200, user="ann")
    c = Collector(config)
    c.refresh_store()
    c.fold()
    doc = c.document()
    (host,) = doc["hosts"]
    assert host["gpus"] == []  # "here" (local, no NVML here) is down, or not yet answered
    assert [(r["host"], r["gpu"], r["user"]) for r in doc["reservations"]] == [
        ("here", 3, made[0].user), ("gone", 0, "ann")]
    assert check(json.loads(json.dumps(doc)))["reservations"] == doc["reservations"]
    text = render(lambda: families(doc, {}, HubCounts(0, 0, 0, 0, 0, 0, 0, 0))).decode()
    assert 'gputop_reservation_info{gpu="0",holder="ann",host="gone",kind="reservation",' \
        'mig_instance=""} 1.0' in text
    assert sum(line.startswith("gputop_reservation_info{") for line in text.splitlines()) == 2
    # Made once per read of the file, not per fold (a file of 10,000 cost 0.4 s a fold).
    listed = doc["reservations"]
    for _ in range(3):
        c.fold()
        assert c.document()["reservations"] is listed
    # One whose end passed since the list was made is no series.
    ended = dict(listed[1], expires="2000-01-01T00:00:00Z")
    text = render(lambda: families(doc | {"reservations": [listed[0], ended]}, {},
                                   HubCounts(0, 0, 0, 0, 0, 0, 0, 0))).decode()
    assert sum(line.startswith("gputop_reservation_info{") for line in text.splitlines()) == 1


def test_serve_demo_is_a_hub_of_the_simulated_fleet_that_leaves_nothing(
        tmp_path: Path) -> None:
    """A newcomer with no hosts sees the web board, /metrics and the stream: `gputop serve
    --demo` reads no hosts file, serves the demo fleet with its seeded reservations, and
    its temporary reservations folder is gone once SIGTERM ends it (exit 143)."""
    import os
    import signal
    import time

    from gputop.history.db import HistoryDB
    from tests.support.hubs import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUTOP_")}
    env |= {"TMPDIR": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "nothing"),
            "XDG_DATA_HOME": str(tmp_path / "data")}
    # The user's own history database: never the demo's (it served its waste).
    mine = tmp_path / "data" / "gputop" / "history.sqlite3"
    mine.parent.mkdir(parents=True)
    HistoryDB(mine, writer=True).close()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gputop", "serve", "--demo", "--listen",
                             f"127.0.0.1:{port}"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if get(f"{url}/-/ready")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "never ready"
            time.sleep(0.2)
        doc = json.loads(get(f"{url}/api/v1/snapshot")[2])
        assert {h["source"] for h in doc["hosts"]} == {"demo"}
        assert doc["reservations"], "the demo's seeded reservations"
        assert b"gputop_gpu_info{" in get(f"{url}/metrics")[2]
        assert json.loads(get(f"{url}/api/v1/waste")[2])["available"] is False
        assert any(p.startswith("gputop-demo") for p in os.listdir(tmp_path))  # (running)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 143, err
    assert [p for p in os.listdir(tmp_path) if p.startswith("gputop-demo")] == []
    r = subprocess.run([sys.executable, "-m", "gputop", "--demo", "serve"], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--demo goes after serve: gputop serve --demo" in r.stderr
    r = subprocess.run([sys.executable, "-m", "gputop", "serve", "--demo", "--print-unit"],
                       env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "not the demo's" in r.stderr
    for extra, said in ((["--config", str(mine)], "reads no hosts file: drop --config"),
                        (["--interval", "0.01"], "--interval must be at least 0.1 seconds")):
        r = subprocess.run([sys.executable, "-m", "gputop", "serve", "--demo", *extra],
                           env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and said in r.stderr, r.stderr
