"""People's own notification routes in the shared reservations file: set only by their
owner (real users gtalice and gtbob), validated, counted in the owner's budget, and a
file with routes refused whole by an older gputop, never half-read or written over."""

from __future__ import annotations

import json
import multiprocessing
import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest
from as_user import need_test_users, run_as, shared_tmp, team_dir

from gputop.notify.routes import clear_routes, routes_for, set_route
from gputop.notify_config import NotifyConfig
from gputop.reservations.ops import Invalid, Target, reserve, whoami
from gputop.reservations.records import MAX_USER_ENTRIES
from gputop.reservations.state import OverBudget
from gputop.reservations.store import Store, StoreError

ROOT = Path(__file__).resolve().parents[1]
#: gputop as it was before routes (the commit they were built on).
BEFORE_ROUTES = "76acca7"


def test_a_file_is_version_4_only_while_it_holds_routes(tmp_path: Path) -> None:
    store = Store(tmp_path / "r.json")
    set_route(store, "email", "me@lab.example")
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["version"] == 4 and doc["routes"][0]["target"] == "me@lab.example"
    set_route(store, "email", "other@lab.example")  # one of each kind: replaced
    set_route(store, "ntfy", "https://ntfy.sh/my-gpus")
    me = whoami(store)[0]
    assert [(r.kind, r.target) for r in routes_for(store.read(), me, NotifyConfig())] == [
        ("email", "other@lab.example"), ("ntfy", "https://ntfy.sh/my-gpus")]
    assert clear_routes(store) == 2
    assert json.loads((tmp_path / "r.json").read_text())["version"] == 1
    assert routes_for(store.read(), me, NotifyConfig(email_domain="lab.example"))[
        0].target == f"{me}@lab.example"


def test_an_older_gputop_refuses_a_file_with_routes_and_leaves_it(tmp_path: Path) -> None:
    old = tmp_path / "old"
    old.mkdir()
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", BEFORE_ROUTES,
                                  "gputop"], capture_output=True, timeout=60, check=True)
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True,
                       timeout=60)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("needs the git history (gputop before routes)")
    path = tmp_path / "r.json"
    store = Store(path)
    reserve(store, [Target("h", 0)], seconds=3600, max_seconds=86400)
    set_route(store, "webhook", "https://hooks.lab.example/me")
    before = path.read_bytes()
    code = ("import sys\nfrom gputop.reservations.store import Store, StoreError\n"
            "for act in ('read', 'update'):\n"
            "    try:\n"
            f"        s = Store({str(path)!r})\n"
            "        s.read() if act == 'read' else s.update(lambda st, now: st)\n"
            "        print(act, 'accepted')\n"
            "    except StoreError as exc:\n"
            "        print(act, 'refused:', exc)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=old, env={"PATH": os.environ["PATH"],
                                                 "PYTHONPATH": str(old)})
    assert r.returncode == 0, r.stderr
    assert "read refused" in r.stdout and "update refused" in r.stdout, r.stdout
    assert "unknown version 4" in r.stdout and "upgrade gputop" in r.stdout
    assert path.read_bytes() == before


def test_routes_are_validated_and_bounded(tmp_path: Path) -> None:
    store = Store(tmp_path / "r.json")
    for kind, bad in (("email", "ann@lab.example\r\nBcc: x@evil.example"),
                      ("email", "not an address"), ("ntfy", "javascript:alert(1)"),
                      ("webhook", "https://user:pw@hooks.example/x y"),
                      ("webhook", "https://hooks.example/" + "a" * 600), ("sms", "123")):
        with pytest.raises(Invalid):
            set_route(store, kind, bad)
    assert not (tmp_path / "r.json").exists()
    # a route written into the file by hand is read as strictly: the file is refused whole
    (tmp_path / "r.json").write_text(json.dumps({"version": 4, "reservations": [],
                                                 "events": [], "queue": [], "routes": [
        {"user": "ann", "kind": "webhook", "target": "file:///etc/passwd",
         "set": "2026-12-05T00:00:00Z"}]}))
    with pytest.raises(StoreError, match="not an http"):
        store.read()


def test_routes_count_in_their_owners_budget(tmp_path: Path) -> None:
    store = Store(tmp_path / "r.json")
    reserve(store, [Target("h", i) for i in range(MAX_USER_ENTRIES)], seconds=3600,
            max_seconds=86400)
    with pytest.raises(OverBudget):
        set_route(store, "email", "me@lab.example")
    assert store.read().routes == ()


def _forge_as(user: str, path: str, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """As ``user``: rewrite everyone's routes to point at the forger, through the store."""
    from dataclasses import replace

    pw = pwd.getpwnam(user)
    os.setgroups([])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
    store = Store(Path(path))
    try:
        store.update(lambda st, now: replace(st, routes=tuple(
            replace(r, target="https://evil.example/") for r in st.routes)))
        out.put("written")
    except StoreError as exc:
        out.put(f"refused: {exc}")


def test_a_route_is_set_and_removed_only_by_its_owner() -> None:
    need_test_users()
    with shared_tmp() as root:
        team = team_dir(root)
        path = team / "reservations.json"
        cfg = root / "hosts.toml"
        cfg.write_text(f'hosts = ["h"]\n[reservations]\npath = "{path}"\n')
        cfg.chmod(0o644)
        env = {"PATH": os.environ["PATH"], "HOME": str(root)}
        r = run_as("gtalice", ["--config", str(cfg), "notify", "me", "--email",
                               "alice@lab.example"], env, root)
        assert r.returncode == 0, r.stderr
        path.chmod(0o666)  # a team's group-writable file: anyone may write the bytes
        r = run_as("gtbob", ["--config", str(cfg), "notify", "me", "--ntfy",
                             "https://ntfy.sh/bob"], env, root)
        assert r.returncode == 0, r.stderr
        r = run_as("gtbob", ["--config", str(cfg), "notify", "me", "--off"], env, root)
        assert r.returncode == 0 and "removed 1 route" in r.stdout, r.stdout + r.stderr
        set_before = Store(path).read().routes
        assert [(x.user, x.target) for x in set_before] == [("gtalice", "alice@lab.example")]
        ctx = multiprocessing.get_context("fork")
        out: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
        child = ctx.Process(target=_forge_as, args=("gtbob", str(path), out))
        child.start()
        child.join(30)
        said = out.get(timeout=5)
        assert said.startswith("refused:") and "gtbob may not set or remove" in said
        assert "gtalice" in said
        assert Store(path).read().routes == set_before
        r = run_as("gtalice", ["--config", str(cfg), "notify", "status"], env, root)
        assert "alice@lab.example" in r.stdout, r.stdout + r.stderr
