"""The web board's test helpers: headless Chromium through Selenium, and a hub whose
document is written by the test (for 200 hosts x 8 GPUs, which no loopback fleet on a
2-core machine runs: the real ``gputop.hub.server.Hub`` app, its event log and its
routes, with a stand-in for the collector only). Used by tests/test_web_board.py and
bench/web_soak.py."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import threading
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from gputop.hubclient.client import fleet_from_document
from gputop.reservations.summary import fleet_summary
from gputop.reservations.terms import Target, Terms

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def chromium_missing() -> str | None:
    for p in (CHROMIUM, CHROMEDRIVER):
        if not Path(p).exists():
            return f"{p} is not installed (Debian: apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    return None


def browser(width: int = 1600, height: int = 1000, *, dark: bool = True) -> Any:
    """A headless Chromium; its console is kept (``get_log("browser")``)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              f"--window-size={width},{height}", "--hide-scrollbars",
              "--disable-background-networking", "--no-first-run",
              "--disable-features=Translate,MediaRouter",
              "--js-flags=--expose-gc", "--enable-precise-memory-info",
              f"--blink-settings=preferredColorScheme={1 if not dark else 0}"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(60)
    return driver


def set_size(driver: Any, width: int, height: int) -> None:
    """The viewport (not the window) at width x height, as a screen of that size shows it."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600})


def color_scheme(driver: Any, scheme: str) -> None:
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {
        "features": [{"name": "prefers-color-scheme", "value": scheme}]})


# --- a synthetic fleet document ------------------------------------------------------------


def iso(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


MODELS = (("NVIDIA H100 80GB HBM3", 81559, "h100"), ("NVIDIA A100-SXM4-80GB", 81920, "a100"),
          ("NVIDIA L40S", 46068, "l40s"))
USERS = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi")
COMMANDS = ("python train.py --config exp/llama-7b.yaml", "torchrun --nproc 8 pretrain.py",
            "jupyter-lab", "python -m vllm.entrypoints.api_server", "./bench --all")


def gpu_doc(host: str, i: int, rnd: random.Random, now: datetime,
            model: int = 0) -> dict[str, Any]:
    name, total, _ = MODELS[model % len(MODELS)]
    busy = rnd.random() < 0.65
    util = rnd.randint(30, 100) if busy else rnd.randint(0, 3)
    used = rnd.randint(total // 10, total - 2000) if busy else 0
    procs = []
    if busy:
        for k in range(rnd.randint(1, 2)):
            procs.append({"pid": 1000 + 37 * i + k, "user": rnd.choice(USERS),
                          "command": rnd.choice(COMMANDS), "gpu_memory_mib": used // 2,
                          "elapsed_s": rnd.randint(60, 90000)})
    res = None
    flags: list[str] = []
    if rnd.random() < 0.3:
        u = procs[0]["user"] if procs and rnd.random() < 0.7 else rnd.choice(USERS)
        res = {"id": f"r{host}{i}", "host": host, "gpu": i, "user": u, "machine": "ws",
               "created": iso(now - timedelta(hours=1)),
               "expires": iso(now + timedelta(minutes=rnd.randint(5, 600))),
               "note": rnd.choice(("", "ablation run", "paper deadline"))}
        if not procs:
            flags.append("idle-reservation")
    elif procs and rnd.random() < 0.15:
        flags.append("unreserved-use")
    return {"index": i, "uuid": f"GPU-{host}-{i:02d}", "name": name,
            "bus_id": f"00000000:{i + 16:02X}:00.0", "utilization_percent": util,
            "memory_utilization_percent": util // 2, "memory_used_mib": used,
            "memory_total_mib": total, "temperature_c": 30 + util // 2,
            "power_draw_w": 60.0 + 6 * util, "power_limit_w": 700.0, "fan_percent": None,
            "pstate": "P0", "mig_mode": "Disabled", "persistence_mode": "Enabled",
            "driver_version": "590.48.01", "lost": False, "lost_reason": None,
            "reservation": res, "flags": flags, "processes": procs, "instances": []}


def host_doc(name: str, gpus: int, rnd: random.Random, now: datetime,
             error: tuple[str, str] | None = None, model: int = 0) -> dict[str, Any]:
    if error is not None:
        return {"name": name, "status": "error", "error": {"kind": error[0],
                "message": error[1]}, "time": iso(now),
                "last_ok": iso(now - timedelta(minutes=7)), "source": "ssh",
                "tags": ["a100"], "warnings": [], "first_sample_s": None, "gpus": []}
    return {"name": name, "status": "ok", "error": None, "time": iso(now), "last_ok": iso(now),
            "source": "ssh", "tags": [MODELS[model % len(MODELS)][2],
                                      f"rack{model % 4}"], "warnings": [],
            "first_sample_s": 1.2,
            "gpus": [gpu_doc(name, i, rnd, now, model) for i in range(gpus)]}


def fleet_doc(hosts: int, gpus: int, seed: int = 1, failing: int = 0) -> dict[str, Any]:
    rnd = random.Random(seed)
    now = datetime.now(timezone.utc).replace(microsecond=0)
    hs = [host_doc(f"gpu-{i:03d}", gpus, rnd, now,
                   ("unreachable", "connection refused") if i < failing else None, i // 3)
          for i in range(hosts)]
    doc = {"version": 5, "time": iso(now), "hosts": hs, "queue": [
        {"id": "q1", "user": "erin", "machine": "ws", "count": 2, "created": iso(now),
         "lease": iso(now + timedelta(minutes=5)), "min_free_mib": 40000, "hosts": [],
         "want": "2 GPUs, 40 GiB free", "one_host": True}]}
    # The hub's count, by its own rule (the page shows it, never counts).
    doc["summary"] = fleet_summary(fleet_from_document(doc).hosts, None, now)
    return doc


def churn(doc: dict[str, Any], rnd: random.Random,
          hosts: int | None = None) -> list[dict[str, Any]]:
    """Move the numbers of ``hosts`` hosts (all: None) as a busy fleet does; the changed
    host objects, complete, as the hub's update carries them."""
    now = iso(datetime.now(timezone.utc))
    pick = doc["hosts"] if hosts is None else rnd.sample(doc["hosts"], hosts)
    out = []
    for h in pick:
        if h["status"] != "ok":
            continue
        h = json.loads(json.dumps(h))
        h["time"] = h["last_ok"] = now
        for g in h["gpus"]:
            if g["processes"]:
                g["utilization_percent"] = rnd.randint(30, 100)
                g["memory_used_mib"] = max(0, min(g["memory_total_mib"], g["memory_used_mib"]
                                                  + rnd.randint(-900, 900)))
            g["temperature_c"] = 30 + (g["utilization_percent"] or 0) // 2
            g["power_draw_w"] = 60.0 + 6 * (g["utilization_percent"] or 0) + rnd.random()
        out.append(h)
    index = {h["name"]: i for i, h in enumerate(doc["hosts"])}
    for h in out:
        doc["hosts"][index[h["name"]]] = h
    return out


def history_db(path: Path) -> None:
    """A day's history at ``path`` in which alice held gpu-000:1 idle for an hour (so the
    page's waste panel has something to show)."""
    from gputop.history.db import HistoryDB
    from gputop.history.recorder import Recorder
    from gputop.model import GpuInfo, HostSnapshot
    from gputop.reservations.state import StoreState
    from gputop.reservations.store import new_reservation

    now = datetime.now(timezone.utc).replace(microsecond=0)
    rec = Recorder(HistoryDB(path, writer=True), interval=30.0, timeout=5.0)
    rec.set_reservations(StoreState(reservations=(new_reservation(
        Target("gpu-000", 1), Terms(86400, user="alice", machine="m"), now - timedelta(hours=3)),)))
    for i in range(120):
        t = now - timedelta(hours=1) + timedelta(seconds=30 * i)
        rec.record(HostSnapshot(name="gpu-000", time=t, gpus=tuple(
            GpuInfo(index=k, uuid=f"GPU-w{k}", name="H100", utilization_percent=0,
                    memory_used_mib=0, memory_total_mib=81559) for k in range(2))))
    rec.flush()
    rec.db.close()


# --- a hub serving that document -------------------------------------------------------------


class DocCollector:
    """What ``Hub`` needs of a collector, holding the test's document."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.names = [h["name"] for h in doc["hosts"]]
        self.stats: dict[str, Any] = {}
        self.ready = True
        self.on_update: Callable[[str, str | None], None] = lambda update, patch: None

    def document(self) -> dict[str, Any]:
        return self.doc

    async def run(self) -> None:
        await asyncio.Event().wait()


class DocHub:
    """``gputop.hub.server.Hub``'s real app on loopback, in a thread with its own loop."""

    def __init__(self, doc: dict[str, Any], config_dir: Path, address: str = "127.0.0.1",
                 token: str | None = None, history: bool = False) -> None:
        """``history``: the hub reads ``config_dir/history.sqlite3`` (see ``history_db``)."""
        from gputop.config.load import load_config
        from gputop.hub.server import Hub

        cfg = config_dir / "hosts.toml"
        db = "history.sqlite3" if history else "none.sqlite3"
        cfg.write_text(f'[reservations]\npath = "{config_dir / "res.json"}"\n'
                       f'[history]\npath = "{config_dir / db}"\n'
                       '[[hosts]]\nname = "x"\nlocal = true\n')
        self.collector = DocCollector(doc)
        #: Each host as last sent (what a patch is worked out against).
        self.sent: dict[str, dict[str, Any]] = {h["name"]: h for h in doc["hosts"]}
        self.hub = Hub(load_config(str(cfg)), collector=self.collector,  # type: ignore[arg-type]
                       token=token)
        self.address = address
        self.loop = asyncio.new_event_loop()
        self.port = 0
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)

    def _run(self, started: threading.Event) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(self.hub.app(), access_log=None)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, self.address, 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.runner = runner
        started.set()
        self.loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}/"

    def publish(self, hosts: list[dict[str, Any]], set_: dict[str, Any] | None = None) -> None:
        """``hosts`` changed: as an update and, as the hub's collector does, a patch."""
        from gputop.hub.patches import host_change
        from gputop.output import dumps

        t = iso(datetime.now(timezone.utc))
        up = dumps({"time": t, "hosts": hosts, "removed": [], "set": set_ or {}})
        whole: list[dict[str, Any]] = []
        changes: list[dict[str, Any]] = []
        for h in hosts:
            change = host_change(self.sent.get(h["name"]), h)
            self.sent[h["name"]] = h
            if change is None:
                whole.append(h)
            else:
                changes.append(change)
        patch = dumps({"time": t, "hosts": whole, "changes": changes, "removed": [],
                       "set": set_ or {}}) if changes else None
        self.publish_raw(up, patch)

    def publish_raw(self, update: str, patch: str | None = None) -> None:
        """One change as the hub's events framed it (``patch`` for readers of patches)."""
        done = threading.Event()

        def go() -> None:
            self.hub._published(update, patch)
            done.set()

        self.loop.call_soon_threadsafe(go)
        done.wait(10)

    def stop(self) -> None:
        async def down() -> None:
            self.hub.events.close_all()
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(down(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
