"""``gputop mcp`` driven by the MCP SDK's own stdio client, against real sshd hosts.

The server is the real command (``python -m gputop mcp``) in its own process, reading a
hosts file of the real-sshd test fleet; the client is ``mcp.client.stdio`` with a
``ClientSession``, as an agent's MCP client runs it. Identity is the server process's real
uid: the environment's USER/LOGNAME say someone else, and the shared file must not care.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.support.fleet import HOSTILE_GPU_NAME, Fleet, GpuProcess, Host
from tests.support.shared_fleet import HOSTILE, need_sshd, world_readable

pytest.importorskip("mcp")
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from gputop.reservations.ops import release, reserve
from gputop.reservations.queue import Queue
from gputop.reservations.requests import Request
from gputop.reservations.store import Store
from gputop.reservations.terms import Target
from gputop.text import clean

ME = pwd.getpwuid(os.getuid()).pw_name
TOOLS = {"fleet_status", "find_gpus", "reserve", "release", "my_reservations",
         "queue_status", "wait_for_gpus"}


@pytest.fixture(scope="module")
def mcp_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two free GPUs on one host; on the other, a teammate's process with a hostile name, a
    GPU whose name is an escape sequence and a lost GPU whose error has one."""
    need_sshd()
    f = Fleet(world_readable(tmp_path_factory.mktemp("mcpfleet")), [
        Host("mcp-free", "127.0.25.2", gpus=("rtx2080", "rtx2080")),
        Host("mcp-busy", "127.0.25.3", gpus=("rtx2080",), scenario="hostile-names", processes=[
            GpuProcess("gtbob", HOSTILE, gpu=0, mem_mib=77)]),
    ]).start()
    yield f
    f.stop()


def config_for(fleet: Fleet, tmp_path: Path) -> tuple[Path, Path]:
    """A hosts file of the fleet with this test's own reservations file."""
    res = tmp_path / "reservations.json"
    text = fleet.write_config(timeout=20.0, interval=0.5).read_text()
    cfg = tmp_path / "hosts.toml"
    cfg.write_text(text.replace(str(fleet.root / "reservations.json"), str(res)))
    return cfg, res


@asynccontextmanager
async def session(fleet: Fleet, cfg: Path) -> AsyncIterator[ClientSession]:
    env = fleet.env() | {"USER": "mallory", "LOGNAME": "mallory"}
    params = StdioServerParameters(command=sys.executable,
                                   args=["-m", "gputop", "mcp", "--config", str(cfg)], env=env)
    async with stdio_client(params) as (read, write), ClientSession(read, write) as s:
        await s.initialize()
        yield s


async def call(s: ClientSession, name: str, **args: Any) -> dict[str, Any]:
    """A tool's result: its text (compact JSON) parsed, checked against its structured
    content. A tool error raises, with its text."""
    r = await s.call_tool(name, args)
    text = r.content[0].text  # type: ignore[union-attr]
    if r.is_error:  # type: ignore[union-attr]
        raise ToolErr(text)
    assert "\n" not in text and text.isascii() and "\x1b" not in text
    doc = json.loads(text)
    assert doc == r.structured_content  # type: ignore[union-attr]
    assert next(iter(doc)) == "summary" and "\n" not in doc["summary"]
    return doc


class ToolErr(Exception):
    pass


def strings(doc: Any) -> Iterator[str]:
    if isinstance(doc, str):
        yield doc
    elif isinstance(doc, dict):
        for k, v in doc.items():
            yield k
            yield from strings(v)
    elif isinstance(doc, list):
        for v in doc:
            yield from strings(v)


async def until_waiting(res: Path, task: asyncio.Task[Any] | None, present: bool) -> None:
    """Until the agent's place in the queue is in the file (or gone), as it happens."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while bool([w for w in json.loads(res.read_text()).get("queue", [])
                if w["user"] == ME]) != present:
        assert task is None or not task.done(), task.result()
        assert loop.time() < deadline, f"the agent's waiter never {'came' if present else 'left'}"
        await asyncio.sleep(0.05)


def holders(res: Path) -> list[tuple[str, int, str]]:
    return sorted((r["host"], r["gpu"], r["user"])
                  for r in json.loads(res.read_text())["reservations"])


async def test_an_agent_finds_reserves_sees_and_releases_two_gpus(
        mcp_fleet: Fleet, tmp_path: Path) -> None:
    cfg, res = config_for(mcp_fleet, tmp_path)
    async with session(mcp_fleet, cfg) as s:
        init = s.initialize_result
        assert init is not None and init.instructions
        assert f"as your user, {ME}" in init.instructions
        assert "never stop, kill" in init.instructions and "Reserve before" in init.instructions
        tools = {t.name: t for t in (await s.list_tools()).tools}
        assert set(tools) == TOOLS
        for name in ("fleet_status", "find_gpus", "my_reservations", "queue_status"):
            assert tools[name].annotations.read_only_hint is True, name  # type: ignore[union-attr]
        assert tools["release"].annotations.destructive_hint is True  # type: ignore[union-attr]
        assert tools["reserve"].annotations.read_only_hint is False  # type: ignore[union-attr]
        for t in tools.values():  # identity is never a tool argument
            assert not {"user", "login", "as_user"} & set(t.input_schema["properties"]), t.name
            # described as written for a reader: no source indentation carried along
            assert t.description and "\n " not in t.description, (t.name, t.description)

        found = await call(s, "find_gpus", count=2)
        assert found["enough"] and found["summary"].startswith("2 free, 2 wanted")
        labels = [g["gpu"] for g in found["found"]]
        assert sorted(labels) == ["mcp-free:0", "mcp-free:1"]

        made = await call(s, "reserve", gpus=labels, duration="1h", note="sweep 7")
        assert {d["gpu"] for d in made["reserved"]} == set(labels)
        assert made["summary"].startswith("reserved mcp-free:")
        # The shared file names the server process's user, not $USER.
        assert holders(res) == [("mcp-free", 0, ME), ("mcp-free", 1, ME)]
        assert ME != "mallory"

        mine = await call(s, "my_reservations")
        assert [(r["gpu"], r["mine"], r["note"]) for r in mine["reservations"]] == [
            ("mcp-free:0", True, "sweep 7"), ("mcp-free:1", True, "sweep 7")]
        assert "hold 2 reservation(s)" in mine["summary"]

        status = await call(s, "fleet_status", host="mcp-free")
        assert [g["state"] for g in status["hosts"][0]["gpus"]] == ["mine", "mine"]
        again = await call(s, "find_gpus", count=1)  # yours count as free to you
        assert again["found"][0]["yours_until"] is not None

        gone = await call(s, "release", gpus=labels)
        assert sorted(gone["released"]) == labels
        assert holders(res) == []
        assert (await call(s, "my_reservations"))["reservations"] == []

        # A memory share of one GPU: found, taken under the same identity, shown, released.
        fit = await call(s, "find_gpus", share_gib=2)
        assert fit["enough"] and fit["found"][0]["share_mib"] == 2048
        share = await call(s, "reserve", gpus=[fit["found"][0]["gpu"]], share_gib=2)
        assert share["summary"].startswith("reserved a 2G share of mcp-free:")
        (rec,) = json.loads(res.read_text())["reservations"]
        assert (rec["user"], rec["share_mib"]) == (ME, 2048)
        status = await call(s, "fleet_status", host="mcp-free")
        shared = [g for g in status["hosts"][0]["gpus"] if g["state"] == "shared"]
        assert [sh["share_mib"] for g in shared for sh in g["shares"]] == [2048]
        assert (await call(s, "release", all_mine=True))["released"] == [rec["host"] + ":"
                                                                      + str(rec["gpu"])]
        assert holders(res) == []


async def test_remote_text_is_data_and_errors_are_classified(
        mcp_fleet: Fleet, tmp_path: Path) -> None:
    cfg, res = config_for(mcp_fleet, tmp_path)
    async with session(mcp_fleet, cfg) as s:
        status = await call(s, "fleet_status")
        busy = next(h for h in status["hosts"] if h["host"] == "mcp-busy")
        g, lost = busy["gpus"]
        (p,) = g["processes"]
        # Hostile text comes back as strings: markup as plain text, escape sequences,
        # control and bidi characters dropped; nothing of it in the summary.
        assert p["user"] == "gtbob" and p["command"].startswith("[bold red]x[/] ")
        assert g["name"] == clean(HOSTILE_GPU_NAME) and "H100" in g["name"]
        assert lost["state"] == "lost" and "Unknown Error" in lost["lost_reason"]
        assert not [t for t in strings(status) if clean(t) != t]
        assert g["state"] == "busy"
        assert "bold" not in status["summary"] and "H100" not in status["summary"]
        assert status["summary"].startswith("2 host(s), 2 up; 4 GPU(s): 2 free, 1 busy"), \
            status["summary"]

        # Someone else's reservation refuses the whole request, naming them.
        reserve(Store(res), [Target("mcp-free", 1)], seconds=3600, max_seconds=7 * 86400,
                user="gtbob")
        with pytest.raises(ToolErr, match=r"^refused: mcp-free:1 is reserved by gtbob"):
            await call(s, "reserve", gpus=["mcp-free:0", "mcp-free:1"])
        assert holders(res) == [("mcp-free", 1, "gtbob")]  # all or nothing
        with pytest.raises(ToolErr, match=r"^refused: .*reserved by gtbob.*; only its holder"):
            await call(s, "release", gpus=["mcp-free:1"])  # an agent never forces
        with pytest.raises(ToolErr, match=r"^invalid: count must be between 1 and 64"):
            await call(s, "find_gpus", count=0)
        with pytest.raises(ToolErr, match=r"^invalid: unknown host 'nope'; hosts: mcp-free"):
            await call(s, "find_gpus", hosts=["nope"])
        with pytest.raises(ToolErr, match=r"^invalid: mcp-free has no GPU 7; its GPUs: 0, 1"):
            await call(s, "reserve", gpus=["mcp-free:7"])
        with pytest.raises(ToolErr, match=r"^invalid: give either gpus"):
            await call(s, "reserve")

        # By count: the one GPU left free; then nothing left, and the bounded wait gives
        # up with the queue's state, leaving the queue.
        got = await call(s, "reserve", count=1, duration="30m")
        assert [d["gpu"] for d in got["reserved"]] == ["mcp-free:0"]
        waited = await call(s, "wait_for_gpus", count=1, max_wait_s=1, hosts=["mcp-free"])
        assert waited["granted"] is False and "not granted within 1s" in waited["summary"]
        assert json.loads(res.read_text()).get("queue", []) == []
        # More than the fleet has: refused at once, never a wait (an agent would loop).
        with pytest.raises(ToolErr, match=r"^invalid: not joining the queue: no host can ever "
                           r"give 25 GPU\(s\) in all .* again cannot help"):
            await call(s, "wait_for_gpus", count=25, max_wait_s=60)
        assert json.loads(res.read_text()).get("queue", []) == []

        # A broken shared file: a classified error, and the file left as it was.
        res.write_text("{not json")
        with pytest.raises(ToolErr, match=r"^store: "):
            await call(s, "my_reservations")
        assert res.read_text() == "{not json"
        status = await call(s, "fleet_status")
        assert "reservations_error" in status and "could not be read" in status["summary"]


async def test_reserve_takes_only_gpus_a_host_is_known_to_have(
        mcp_fleet: Fleet, tmp_path: Path) -> None:
    """Hosts where nothing listens: one never seen takes no GPU (the 5,000-index flood is
    refused whole), one with ``gpus = 2`` in hosts.toml takes 0 and 1 only."""
    cfg, res = config_for(mcp_fleet, tmp_path)
    down = 'address = "127.0.0.1"\nport = 1\n'
    with cfg.open("a") as f:
        f.write(f'[[hosts]]\nname = "mcp-gone"\n{down}\n[[hosts]]\nname = "mcp-said"\n'
                f'{down}gpus = 2\n\n[history]\npath = "{tmp_path / "none.sqlite3"}"\n')
    async with session(mcp_fleet, cfg) as s:
        flood = "mcp-gone:" + ",".join(map(str, range(5000)))
        with pytest.raises(ToolErr, match=r"^invalid: mcp-gone did not answer .*never seen "
                                          r"its GPUs.*gpus = N"):
            await call(s, "reserve", gpus=[flood], duration="7d", note="x" * 200)
        with pytest.raises(ToolErr, match=r"^invalid: mcp-said did not answer .*no GPU 2 "
                                          r"as far as gputop knows \(gpus = 2 in "):
            await call(s, "reserve", gpus=["mcp-said:1,2"])
        assert not res.exists() or holders(res) == []
        got = await call(s, "reserve", gpus=["mcp-said:0,1"])
        assert [d["gpu"] for d in got["reserved"]] == ["mcp-said:0", "mcp-said:1"]
        assert any("could not check mcp-said:1" in w for w in got["warnings"])
    assert holders(res) == [("mcp-said", 0, ME), ("mcp-said", 1, ME)]


async def test_your_own_reservation_on_a_host_that_does_not_answer_is_extended(
        mcp_fleet: Fleet, tmp_path: Path) -> None:
    """A host never seen that does not answer: the agent's own live reservation there may
    be extended; a teammate's entry proves no GPU to it."""
    cfg, res = config_for(mcp_fleet, tmp_path)
    with cfg.open("a") as f:
        f.write('[[hosts]]\nname = "mcp-gone"\naddress = "127.0.0.1"\nport = 1\n\n'
                f'[history]\npath = "{tmp_path / "none.sqlite3"}"\n')
    store = Store(res)
    reserve(store, [Target("mcp-gone", 0)], seconds=600, max_seconds=7 * 86400, user=ME)
    reserve(store, [Target("mcp-gone", 1)], seconds=600, max_seconds=7 * 86400,
            user="gtbob")
    async with session(mcp_fleet, cfg) as s:
        got = await call(s, "reserve", gpus=["mcp-gone:0"], duration="2h")
        assert [d["gpu"] for d in got["reserved"]] == ["mcp-gone:0"]
        with pytest.raises(ToolErr, match=r"^invalid: mcp-gone did not answer .*no GPU 1 "):
            await call(s, "reserve", gpus=["mcp-gone:1"])
    mine = [r for r in json.loads(res.read_text())["reservations"] if r["user"] == ME]
    assert len(mine) == 1
    left = (datetime.fromisoformat(mine[0]["expires"].replace("Z", "+00:00"))
            - datetime.fromisoformat(mine[0]["created"].replace("Z", "+00:00")))
    assert left > timedelta(hours=1)  # extended to 2 h, not the 10 minutes it had
    assert holders(res) == [("mcp-gone", 0, ME), ("mcp-gone", 1, "gtbob")]


async def test_the_queue_comes_first_and_a_bounded_wait_is_granted(
        mcp_fleet: Fleet, tmp_path: Path) -> None:
    """A teammate waits for a GPU on the host: the agent is offered none there and may not
    reserve the idle one by name (the order rule, as for `gputop free` and `reserve`).
    Then the agent waits its turn and is granted both GPUs once the teammate's goes."""
    cfg, res = config_for(mcp_fleet, tmp_path)
    store = Store(res)
    reserve(store, [Target("mcp-free", 1)], seconds=3600, max_seconds=7 * 86400, user="gtbob")
    bob = Queue(store, Request(1, 0, ("mcp-free",)), lease_s=300, user="gtbob")
    bob.join()
    async with session(mcp_fleet, cfg) as s:
        found = await call(s, "find_gpus", count=1, hosts=["mcp-free"])
        assert not found["enough"] and found["found"] == []
        assert "1 waiting in the queue" in found["summary"]
        status = await call(s, "fleet_status", host="mcp-free")
        assert [g["state"] for g in status["hosts"][0]["gpus"]] == ["queued", "reserved"]
        with pytest.raises(ToolErr, match=r"^refused: mcp-free:0 is one the queue waits for"
                           r".*gtbob.*For you \(an agent\): wait_for_gpus joins the queue"):
            await call(s, "reserve", gpus=["mcp-free:0"])
        q = await call(s, "queue_status")
        assert [(w["user"], w["mine"], w["count"]) for w in q["queue"]] == [("gtbob", False, 1)]
        assert [r["gpu"] for r in q["reservations"]] == ["mcp-free:1"]
        bob.leave()

        # A wait the agent's client abandons leaves the queue at once (not after its lease).
        wait = asyncio.create_task(call(s, "wait_for_gpus", count=2, hosts=["mcp-free"],
                                        max_wait_s=120))
        await until_waiting(res, wait, True)
        wait.cancel()
        await until_waiting(res, None, False)

        wait = asyncio.create_task(call(s, "wait_for_gpus", count=2, hosts=["mcp-free"],
                                        duration="20m", max_wait_s=120))
        await until_waiting(res, wait, True)
        assert holders(res) == [("mcp-free", 1, "gtbob")]
        # Other calls are answered while the wait goes on.
        q = await call(s, "queue_status")
        assert [(w["user"], w["mine"], w["count"]) for w in q["queue"]] == [(ME, True, 2)]
        assert "you at position(s) 1" in q["summary"]
        await asyncio.to_thread(release, store, None, user="gtbob")
        got = await asyncio.wait_for(wait, 60)
        assert got["granted"] is True and got["summary"].startswith("granted 2 whole GPUs")
        assert sorted(d["gpu"] for d in got["reserved"]) == ["mcp-free:0", "mcp-free:1"]
        assert holders(res) == [("mcp-free", 0, ME), ("mcp-free", 1, ME)]
        assert json.loads(res.read_text()).get("queue", []) == []


def test_the_server_never_loads_textual_and_the_commands_never_load_mcp() -> None:
    def loaded(module: str, prefix: str) -> bool:
        code = (f"import sys, {module}\n"
                f"print(any(m == {prefix!r} or m.startswith({prefix!r} + '.') "
                "for m in sys.modules))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip() == "True"

    assert loaded("gputop.agents.mcp", "mcp")  # (the check can fail)
    assert not loaded("gputop.agents.mcp", "textual")
    assert not loaded("gputop.cli.main, gputop.cli.subcommands, gputop.cli.headless", "mcp")


async def test_long_fleets_are_counted_and_remote_text_is_bounded() -> None:
    """In-process, on the demo's simulated hosts (a real source; no SSH): above the detail
    bound each host's GPUs are counted, a host or tag gives them one by one; remote text
    is cleaned and cut whatever the source let through."""
    from gputop.agents.tools import FleetTools
    from gputop.agents.views import MAX_COMMAND, data
    from gputop.poller import Poller
    from gputop.sources.demo import demo_session

    with demo_session() as (config, sources):
        tools = FleetTools(config, Poller(config, sources))
        try:
            tools.max_detail = 8
            doc = await tools.fleet_status()
            assert "counts only" in doc["summary"]
            assert all("gpus" not in h for h in doc["hosts"])
            up = [h for h in doc["hosts"] if h["status"] == "ok"]
            assert sum(h["gpu_counts"]["total"] for h in up) == 22
            down = [h for h in doc["hosts"] if h["status"] == "error"]
            assert [h["error"]["kind"] for h in down] == ["unreachable"]
            narrow = await tools.fleet_status(tag="h100")
            assert [len(h["gpus"]) for h in narrow["hosts"]] == [8, 0]
            monkey = pytest.MonkeyPatch()  # a host listing more GPUs than one answer holds
            monkey.setattr("gputop.agents.tools.MAX_HOST_GPUS", 3)
            try:
                bounded = await tools.fleet_status(tag="h100")
            finally:
                monkey.undo()
            assert [len(h["gpus"]) for h in bounded["hosts"]] == [3, 0]
            assert bounded["hosts"][0]["gpus_left_out"] == 5
            assert all(len(p["command"]) <= MAX_COMMAND for h in narrow["hosts"]
                       for g in h["gpus"] for p in g["processes"])
        finally:
            await tools.aclose()
    hostile = "\x1b]0;pwned\x07[b]x[/b]\u202e\x9b31m" * 40
    cut = data(hostile, 50)
    assert cut is not None and len(cut) == 50 and cut == clean(cut) and "\x1b" not in cut
    assert cut.startswith("[b]x[/b]") and cut.endswith("…")


async def test_wait_for_gpus_with_notify_sends_the_agents_user_one_grant(
        mcp_fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process (the server's own sender is a recording Notifier): notify=true hands
    one ``granted`` notice for the agent's user, with the command to use the GPU; without
    notify, none; with notify and no sender configured, refused before any wait."""
    from gputop.agents.tools import FleetTools, ToolFailure
    from gputop.config.load import load_config
    from gputop.notify.notice import Notice

    monkeypatch.setenv("HOME", str(mcp_fleet.home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    cfg, _res = config_for(mcp_fleet, tmp_path)
    got: list[Notice] = []

    class Recorder:
        def submit(self, notice: Notice) -> None:
            got.append(notice)

    tools = FleetTools(load_config(str(cfg)))
    try:
        await tools.identity()
        with pytest.raises(ToolFailure, match="no \\[notify\\] sender"):
            await tools.wait_for_gpus(count=1, hosts=["mcp-free"], notify=True)
        tools.notifier = Recorder()
        first = await tools.wait_for_gpus(count=1, hosts=["mcp-free"], max_wait_s=60)
        assert first["granted"] is True and got == []
        done = await tools.wait_for_gpus(count=1, hosts=["mcp-free"], max_wait_s=60,
                                         notify=True)
        assert done["granted"] is True
        assert [(n.kind, n.user) for n in got] == [("granted", ME)]
        gpu = done["reserved"][0]["gpu"].split(":")[1]
        assert f"CUDA_VISIBLE_DEVICES={gpu} on mcp-free" in got[0].lines
    finally:
        await tools.aclose()
