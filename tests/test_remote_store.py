"""The shared file over SSH (``[reservations] path = "HOST:/path"``), against real sshd.

The store host is one of the fleet's hosts; the writers log in as real users of a team
group (``gtcarol``, ``gtdave``: accounts with a shell), and a "laptop" is a local account
(``gtalice``) whose SSH login on the store host is another name. Local writers (the login
node's gputop, the path local) and remote ones share the file and its locks.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from as_user import need_test_users, run_as, user_home
from fleet import TEAM_GROUP, Fleet, Host, ensure_login_users, is_root, sshd_available

from gputop.config import ConfigError, load_config
from gputop.reservations.ops import Target, release, reserve
from gputop.reservations.remote import RemoteStore
from gputop.reservations.state import OverBudget
from gputop.reservations.store import Store, StoreError, StoreState, new_reservation
from gputop.sources.shared_file import open_store

ROOT = Path(__file__).resolve().parents[1]
STORE_IP = "127.0.22.2"
SILENT_IP = "127.0.22.9"


class World:
    def __init__(self, fleet: Fleet, root: Path) -> None:
        self.fleet = fleet
        self.root = root
        self.team = root / "team"
        self.path = self.team / "reservations.json"

    def config(self, user: str, path: Path | None = None, *, host: str | None = None,
               name: str = "hosts", timeout: float = 5) -> Path:
        """A hosts.toml whose reservations file is ``store-as-USER:PATH``."""
        cfg = self.root / f"{name}-{user}.toml"
        where = f"{host or 'store-as-' + user}:{path or self.path}"
        cfg.write_text(f'[defaults]\ntimeout = {timeout}\ninterval = 1\n'
                       f'[reservations]\npath = "{where}"\n'
                       '[[hosts]]\nname = "store"\n[[hosts]]\nname = "gpu"\n')
        cfg.chmod(0o644)
        return cfg

    def store(self, user: str, path: Path | None = None, **kw: Any) -> RemoteStore:
        st = open_store(load_config(str(self.config(user, path, **kw))))
        assert isinstance(st, RemoteStore)
        return st

    def reset(self) -> None:
        for p in self.team.iterdir():
            p.unlink()


def _alias(fleet: Fleet, name: str, host: str, user: str) -> str:
    h = fleet.hosts[host]
    return (f"Host {name}\n  HostName {h.address}\n  Port {h.port}\n  User {user}\n"
            f"  IdentityFile {fleet.ssh / 'id_ed25519'}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {fleet.ssh / 'known_hosts'}\n")


def _hide_flock(fleet: Fleet, host: str) -> None:
    """The host's sessions get a PATH with every standard tool but flock(1)."""
    hdir = fleet.root / host
    nofl = hdir / "nofl"
    nofl.mkdir()
    for d in ("/usr/bin", "/bin"):
        for tool in os.listdir(d):
            if tool != "flock" and not (nofl / tool).exists():
                (nofl / tool).symlink_to(Path(d) / tool)
    cfg = hdir / "sshd_config"
    cfg.write_text("\n".join(f"SetEnv PATH={nofl}" if ln.startswith("SetEnv PATH=") else ln
                             for ln in cfg.read_text().splitlines()) + "\n")
    fleet.stop_sshd(fleet.hosts[host])
    fleet.restart_sshd(fleet.hosts[host])


@pytest.fixture(scope="module")
def world(monkeypatch_module: pytest.MonkeyPatch) -> Iterator[World]:
    if sshd_available() or not is_root() or shutil.which("flock") is None:
        pytest.skip("needs sshd, root (for the login users) and flock(1)")
    users = ensure_login_users()
    if len(users) < 2:
        pytest.skip("needs the SSH login users")
    root = Path(tempfile.mkdtemp(prefix="gputop-remote-store-", dir="/tmp"))
    root.chmod(0o755)
    fleet = Fleet(root, [Host("store", STORE_IP), Host("gpu", "127.0.22.3", gpus=("rtx2080",)),
                         Host("noflock", "127.0.22.4")]).start()
    try:
        with (fleet.ssh / "config").open("a") as f:
            for u in (*users, "root"):
                f.write("\n" + _alias(fleet, f"store-as-{u}", "store", u))
            f.write("\n" + _alias(fleet, "noflock-as-gtcarol", "noflock", "gtcarol"))
            # A host whose TCP port accepts and never speaks (a hung sshd).
            f.write("\n" + _alias(fleet, "silent", "store", "gtcarol")
                    .replace(STORE_IP, SILENT_IP))
        silent = socket.socket()
        silent.bind((SILENT_IP, fleet.port))
        silent.listen(16)
        _hide_flock(fleet, "noflock")
        w = World(fleet, root)
        w.team.mkdir()
        os.chown(w.team, 0, grp.getgrnam(TEAM_GROUP).gr_gid)
        w.team.chmod(0o2775)  # a team's shared directory: setgid, group-writable
        monkeypatch_module.setenv("HOME", str(fleet.home))
        monkeypatch_module.delenv("SSH_AUTH_SOCK", raising=False)
        monkeypatch_module.delenv("GPUTOP_RESERVATIONS", raising=False)
        yield w
    finally:
        fleet.stop()
        with contextlib.suppress(NameError):
            silent.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture
def clean(world: World) -> World:
    world.reset()
    return world


def _ids(state: StoreState) -> set[tuple[str, int, str]]:
    return {(r.host, r.gpu, r.user) for r in state.reservations}


# --- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value, problem", [
    ("store:relative/r.json", "must be absolute"),
    ("-oProxyCommand=x:/r.json", "is not a host name"),
    ("store:/dir/", "is not a file path"),
])
def test_a_bad_remote_path_names_file_and_key(tmp_path: Path, value: str,
                                              problem: str) -> None:
    cfg = tmp_path / "hosts.toml"
    cfg.write_text(f'[reservations]\npath = "{value}"\n[[hosts]]\nname = "a"\n')
    with pytest.raises(ConfigError) as e:
        load_config(str(cfg))
    assert "reservations.path" in str(e.value) and problem in str(e.value)
    assert str(cfg) in str(e.value)


def test_a_bad_remote_path_in_the_environment_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUTOP_RESERVATIONS", "-oProxyCommand=sh:/r.json")
    monkeypatch.delenv("GPUTOP_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match=r"\$GPUTOP_RESERVATIONS: .*not a host name"):
        load_config(None)
    cfg = tmp_path / "hosts.toml"
    cfg.write_text('[[hosts]]\nname = "a"\n')
    with pytest.raises(ConfigError, match=r"GPUTOP_RESERVATIONS: .*not a host name"):
        load_config(str(cfg))


def test_scp_style_path_is_remote_and_a_slash_path_is_not(tmp_path: Path) -> None:
    cfg = tmp_path / "hosts.toml"
    cfg.write_text('[reservations]\npath = "login-1:/shared/r.json"\n[[hosts]]\nname = "a"\n')
    c = load_config(str(cfg))
    assert (c.reservations_host, str(c.reservations_path)) == ("login-1", "/shared/r.json")
    cfg.write_text('[reservations]\npath = "./odd:name/r.json"\n[[hosts]]\nname = "a"\n')
    c = load_config(str(cfg))
    assert c.reservations_host is None and c.reservations_path == tmp_path / "odd:name/r.json"


# --- identity, reads ------------------------------------------------------------------------


def test_me_is_the_account_the_store_host_authenticated(clean: World) -> None:
    st = clean.store("gtcarol")
    assert st.whoami()[0] == "gtcarol"  # this process runs as root
    reserve(st, [Target("gpu", 0)], seconds=600, max_seconds=3600, note="über")
    on_disk = json.loads(clean.path.read_text())
    assert [(r["user"], r["host"], r["note"]) for r in on_disk["reservations"]] == [
        ("gtcarol", "gpu", "über")]
    # Written by the login user, in the team's group, group-writable: a teammate's
    # writer (local or remote) can replace it.
    stt = clean.path.stat()
    assert pwd.getpwuid(stt.st_uid).pw_name == "gtcarol"
    assert grp.getgrgid(stt.st_gid).gr_name == TEAM_GROUP and stt.st_mode & 0o060 == 0o060
    # Someone else's over SSH: refused without --force, as with a local file.
    with pytest.raises(Exception, match="reserved by gtcarol"):
        reserve(clean.store("gtdave"), [Target("gpu", 0)], seconds=60, max_seconds=3600)
    assert release(st, None)[0].user == "gtcarol"
    assert clean.store("gtdave").read().reservations == ()


def test_the_budget_holds_over_ssh_for_that_user_alone(clean: World) -> None:
    """A flood written over SSH is refused by the per-user budget, as with a local file,
    and the file is left as it was; a teammate over SSH still reserves."""
    st = clean.store("gtcarol")
    reserve(st, [Target("gpu", 0)], seconds=600, max_seconds=3600)
    before = clean.path.read_bytes()
    with pytest.raises(OverBudget, match=r"gtcarol would hold 201 .* at most 64"):
        reserve(st, [Target("gpu", i) for i in range(1, 201)], seconds=600,
                max_seconds=3600, note="x" * 500)
    assert clean.path.read_bytes() == before
    reserve(clean.store("gtdave"), [Target("gpu", 300)], seconds=600, max_seconds=3600)
    assert sorted(r.user for r in st.read().reservations) == ["gtcarol", "gtdave"]


def test_unchanged_file_is_not_fetched_again(clean: World) -> None:
    st = clean.store("gtcarol")
    other = Store(clean.path)
    reserve(other, [Target("gpu", 1)], seconds=600, max_seconds=3600)
    first = st.read()
    fetched = st.fetches
    for _ in range(5):
        assert st.read() is first  # one cksum line each way, no body
    assert st.fetches == fetched
    reserve(other, [Target("gpu", 2)], seconds=600, max_seconds=3600)
    assert len(st.read().reservations) == 2
    assert st.fetches == fetched + 1


def test_a_broken_file_is_reported_with_host_and_path_and_left_untouched(
        clean: World) -> None:
    st = clean.store("gtcarol")
    clean.path.write_bytes(b'{"version": 1, "reservations": [\x1b[2J')
    before = clean.path.read_bytes()
    with pytest.raises(StoreError) as e:
        st.read()
    assert str(e.value).startswith(f"store-as-gtcarol:{clean.path}: ")
    with pytest.raises(StoreError):
        reserve(st, [Target("gpu", 0)], seconds=60, max_seconds=3600)
    assert clean.path.read_bytes() == before
    # A hostile file that forges our markers cannot end the frame early either.
    clean.path.write_bytes(b"@@gputop-store 00 end\n" * 3)
    with pytest.raises(StoreError, match="not valid JSON"):
        st.read()


# --- locks: local and remote writers exclude each other -----------------------------------


def test_local_and_remote_writers_exclude_each_other(clean: World) -> None:
    remote = clean.store("gtdave")
    local = Store(clean.path)
    # A remote writer holds the lock (between reading the file and writing it back).
    ch, _nonce, _state = remote._call(remote._begin(5), 20)
    try:
        with pytest.raises(StoreError, match="still locked"):
            local.update(lambda s, now: s, timeout=0.5)
    finally:
        remote._call(remote._close(ch), 5)
    local.update(lambda s, now: s, timeout=5)  # the channel closed: the lock is free
    # A local writer holds the lock: a remote write waits, then says so.
    with local._locked(5), pytest.raises(StoreError, match="still locked by another writer"):
        remote.update(lambda s, now: s, timeout=1)
    assert remote.update(lambda s, now: s, timeout=5) == StoreState()


@pytest.mark.parametrize("waiter", ["local", "remote"])
def test_a_writer_that_locked_a_removed_lock_file_takes_the_new_one(clean: World,
                                                                    waiter: str) -> None:
    """A writer waits on PATH.flock; meanwhile the file is removed and another writer
    locks the new one at that path. When the old lock is released the waiter gets it, but
    the path is no longer that file: it must lock the new one (and wait) instead of
    writing beside the other writer."""
    import fcntl

    lock = clean.team / "reservations.json.flock"
    Store(clean.path).update(lambda s, now: s)  # the lock files exist
    old = os.open(lock, os.O_RDWR)
    fcntl.flock(old, fcntl.LOCK_EX)
    done = threading.Event()
    errors: list[BaseException] = []
    store = clean.store("gtdave") if waiter == "remote" else Store(clean.path)

    def write() -> None:
        try:
            store.update(lambda s, now: s, timeout=20)
            done.set()
        except BaseException as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=write)
    new = -1
    try:
        t.start()
        assert not done.wait(0.5)  # waiting on the old file
        lock.rename(clean.team / "gone.flock")
        new = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        os.fchmod(new, 0o664)  # the team's group may use it
        fcntl.flock(new, fcntl.LOCK_EX)  # another writer holds the lock at the path now
        os.close(old)
        old = -1
        assert not done.wait(1.0), "wrote while another writer held the lock at the path"
        os.close(new)
        new = -1
        t.join(20)
        assert done.is_set() and not errors, errors
    finally:
        for fd in (old, new):
            if fd >= 0:
                os.close(fd)
        t.join(20)
        (clean.team / "gone.flock").unlink(missing_ok=True)


def test_a_remote_writer_whose_lock_file_is_removed_loses_nobodys_update(
        clean: World) -> None:
    """As for a local writer (test_fair_store): a remote writer stalls inside its update,
    someone removes the lock files, a local writer locks new ones and reserves gpu:1. The
    remote writer must not write over that: its script sees the lock file is no longer the
    one it locked, writes nothing, and gputop applies the change again."""
    remote = clean.store("gtdave")
    Store(clean.path).update(lambda s, now: s)
    inside, go = threading.Event(), threading.Event()
    calls: list[int] = []

    def change(state: StoreState, now: datetime) -> StoreState:
        calls.append(len(state.reservations))
        if len(calls) == 1:
            inside.set()
            assert go.wait(30)
        return replace(state, reservations=(*state.reservations, new_reservation(
            "gpu", 0, "gtdave", "m", now, 600, None, "")))

    errors: list[BaseException] = []

    def write() -> None:
        try:
            remote.update(change, timeout=20)
        except BaseException as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=write)
    t.start()
    try:
        assert inside.wait(30)
        for name in ("reservations.json.lock", "reservations.json.flock"):
            (clean.team / name).unlink()
        reserve(Store(clean.path), [Target("gpu", 1)], seconds=600, max_seconds=3600)
    finally:
        go.set()
        t.join(30)
    assert not errors, errors
    assert _ids(Store(clean.path).read()) == {("gpu", 0, "gtdave"), ("gpu", 1, "root")}
    assert calls == [0, 1]  # applied again, to the file with the local writer's


def test_concurrent_local_and_remote_writers_lose_nothing(clean: World) -> None:
    n = 12
    writers = {"gtcarol": clean.store("gtcarol"), "gtdave": clean.store("gtdave"),
               "root": Store(clean.path)}
    errors: list[BaseException] = []

    def write(i: int, user: str) -> None:
        try:
            for k in range(n):
                reserve(writers[user], [Target("gpu", i * 100 + k)], seconds=600,
                        max_seconds=3600)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i, u)) for i, u in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    got = _ids(Store(clean.path).read())
    assert got == {("gpu", i * 100 + k, u) for i, u in enumerate(writers) for k in range(n)}


# --- kill -9 of a writer at each step -------------------------------------------------------

CHILD = r"""
import sys, time
from gputop.config import load_config
from gputop.model import utcnow
from gputop.reservations.ops import Target, reserve
from gputop.reservations.remote import MARK
from gputop.reservations.store import encode, new_reservation, replace
from gputop.sources.shared_file import open_store

st = open_store(load_config(sys.argv[1]))
point = sys.argv[2]
if len(sys.argv) > 3:
    st.hold_s = int(sys.argv[3])
ch, nonce, state = st._call(st._begin(10), 30)
r = new_reservation("gpu", 7, "gtdave", "x", utcnow(), 600, None, "")
data = encode(replace(state, reservations=state.reservations + (r,)), st._named)
head = f"{nonce} write {len(data)}\n".encode()
send = {"locked": b"", "partial": head + data[: len(data) // 2], "all-but-commit": head + data,
        "committed": head + data + f"{MARK} {nonce} commit\n".encode()}[point]

async def go():
    ch.write(send)
    if point == "committed":
        ch.proc.stdin.write_eof()

st._call(go(), 10)
print("ready", flush=True)
time.sleep(120)
"""


def _user_pids(user: str) -> list[int]:
    uid = pwd.getpwnam(user).pw_uid
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and d.stat().st_uid == uid:
                out.append(int(d.name))
        except OSError:
            continue
    return out


@contextlib.contextmanager
def _store_host_down(world: World, login: str = "gtcarol") -> Iterator[None]:
    """The store's host down for the block, then back. Its sessions go too: the login's
    own "sshd: user@notty" holds the connection, and stop_sshd ends only the listener's
    children; so ``login``'s processes are killed, by pid (only this test's login user)."""
    h = world.fleet.hosts["store"]
    world.fleet.stop_sshd(h)
    for pid in _user_pids(login):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    try:
        yield
    finally:
        world.fleet.restart_sshd(h)


def _script_pids(user: str, root: Path) -> list[int]:
    """``user``'s writer scripts under this fleet's sshd (found up the parent chain: a
    benchmark running beside the tests has its own)."""
    uid = pwd.getpwnam(user).pw_uid
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if d.stat().st_uid == uid and b"flock -x" in (d / "cmdline").read_bytes() \
                    and _under(int(d.name), str(root).encode()):
                out.append(int(d.name))
        except OSError:
            continue
    return out


def _under(pid: int, needle: bytes) -> bool:
    for _ in range(8):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
            if pid <= 1:
                return False
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
        except (OSError, ValueError, IndexError):
            return False
    return False


@pytest.mark.parametrize("point", ["locked", "partial", "all-but-commit", "committed"])
def test_kill9_of_a_writer_leaves_no_broken_file_and_no_lock(clean: World,
                                                            point: str) -> None:
    Store(clean.path).update(lambda s, now: s)  # nothing, yet a file: keep it that way
    reserve(Store(clean.path), [Target("gpu", 1)], seconds=600, max_seconds=3600)
    before = Store(clean.path).read()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(clean.config("gtdave")), point],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line == b"ready\n", child.stderr.read() if child.stderr else b""
    child.kill()
    child.wait(10)
    # The lock died with the session, long before the script's watchdog (30 s): a local
    # writer gets it within its 10 s wait.
    state = Store(clean.path).update(lambda s, now: s, timeout=10)
    assert _ids(state) in ({("gpu", 1, "root")}, {("gpu", 1, "root"), ("gpu", 7, "gtdave")})
    if point == "committed":
        assert ("gpu", 7, "gtdave") in _ids(state)  # the commit line was all there
    else:
        assert _ids(state) == _ids(before)
    assert not [p for p in clean.team.iterdir() if ".tmp." in p.name]
    deadline = time.monotonic() + 10
    while _script_pids("gtdave", clean.root) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _script_pids("gtdave", clean.root) == []  # nothing left running on the host


def test_a_writer_frozen_with_the_lock_loses_it_to_the_watchdog(clean: World) -> None:
    """A laptop lid shut mid-write: the connection stays open (nobody closes it) and the
    client says nothing; the script's watchdog ends the session after its hold."""
    reserve(Store(clean.path), [Target("gpu", 1)], seconds=600, max_seconds=3600)
    before = clean.path.read_bytes()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(clean.config("gtdave")),
                              "partial", "2"], stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        child.send_signal(signal.SIGSTOP)
        with pytest.raises(StoreError, match="still locked"):
            Store(clean.path).update(lambda s, now: s, timeout=0.5)  # it holds the lock
        deadline = time.monotonic() + 10  # the hold is 2 s
        while _script_pids("gtdave", clean.root) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _script_pids("gtdave", clean.root) == []  # the watchdog ended the session
        # Killed mid-awk: its temp file is left, and the next writer over SSH removes it
        # (under the lock, as a local one would).
        assert [p for p in clean.team.iterdir() if ".tmp." in p.name]
        clean.store("gtdave").update(lambda s, now: s, timeout=5)
        assert not [p for p in clean.team.iterdir() if ".tmp." in p.name]
        Store(clean.path).update(lambda s, now: s, timeout=5)  # the lock is free
        assert clean.path.read_bytes() == before
    finally:
        child.kill()
        child.wait(10)


# --- failures: one clear error naming host and path ------------------------------------------


def test_store_host_down_is_one_error_and_json_still_shows_gpus(clean: World) -> None:
    st = clean.store("gtcarol")
    reserve(st, [Target("gpu", 0)], seconds=600, max_seconds=3600)
    before = clean.path.read_bytes()
    with _store_host_down(clean):
        for attempt in (st.read, lambda: reserve(st, [Target("gpu", 1)], seconds=60,
                                                 max_seconds=3600)):
            with pytest.raises(StoreError) as e:
                attempt()
            msg = str(e.value)
            assert msg.startswith(f"store-as-gtcarol:{clean.path}: cannot reach "
                                  "store-as-gtcarol"), msg
            assert "reservations are unknown" in msg and "\n" not in msg
        r = subprocess.run([sys.executable, "-m", "gputop", "--json", "--config",
                            str(clean.config("gtcarol"))], capture_output=True, text=True,
                           env=clean.fleet.env(), timeout=60)
        doc = json.loads(r.stdout)
        gpu = next(x for x in doc["hosts"] if x["name"] == "gpu")
        assert gpu["gpus"] and "cannot reach" in doc["reservations_error"]
        assert str(clean.path) in doc["reservations_error"]
    assert clean.path.read_bytes() == before
    # Reconnected on its own (after RETRY_S: a host that was down is not asked at every
    # read).
    deadline = time.monotonic() + 15
    while True:
        try:
            assert len(st.read().reservations) == 1
            break
        except StoreError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_a_hung_store_host_costs_one_timeout_then_answers_at_once(
        clean: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the host has failed, reads say so at once and a retry runs in the background:
    a board or --watch reading every interval never waits out a connect timeout again."""
    import gputop.reservations.remote as remote

    monkeypatch.setattr(remote, "RETRY_S", 0.2)
    st = clean.store("gtcarol", host="silent", timeout=1)
    started = time.monotonic()
    with pytest.raises(StoreError, match=r"cannot reach silent .*no answer"):
        st.read()
    assert time.monotonic() - started >= 0.9
    for _ in range(3):
        time.sleep(0.3)  # past RETRY_S: a retry is due (and runs without the caller)
        started = time.monotonic()
        with pytest.raises(StoreError, match="cannot reach silent"):
            st.read()
        assert time.monotonic() - started < 0.5


def test_unwritable_path_names_host_and_path(clean: World) -> None:
    locked = clean.root / "root-only"
    locked.mkdir(exist_ok=True)
    locked.chmod(0o755)
    st = clean.store("gtcarol", locked / "r.json")
    assert st.read() == StoreState()  # no file yet: nothing reserved
    with pytest.raises(StoreError) as e:
        reserve(st, [Target("gpu", 0)], seconds=60, max_seconds=3600)
    msg = str(e.value)
    assert msg.startswith(f"store-as-gtcarol:{locked / 'r.json'}: permission denied")
    assert "on store-as-gtcarol" in msg and "nothing was written" in msg
    assert list(locked.iterdir()) == []


def test_no_flock_on_the_host_is_a_clear_error_and_reads_still_work(clean: World) -> None:
    reserve(Store(clean.path), [Target("gpu", 3)], seconds=600, max_seconds=3600)
    st = clean.store("gtcarol", host="noflock-as-gtcarol")
    assert _ids(st.read()) == {("gpu", 3, "root")}
    with pytest.raises(StoreError, match=r"`flock` \(util-linux\) is not installed on "
                                         "noflock-as-gtcarol"):
        reserve(st, [Target("gpu", 0)], seconds=60, max_seconds=3600)


# --- the CLI from a "laptop": a local account whose login on the store host differs --------


def test_laptop_user_reserves_as_their_account_on_the_store_host(clean: World) -> None:
    need_test_users()
    home = user_home(clean.fleet, clean.root / f"laptop-{time.monotonic_ns()}", "gtalice")
    cfg = clean.config("gtcarol", name="laptop")
    env = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "USER": "root", "LOGNAME": "root"}  # lies: identity never comes from these
    r = run_as("gtalice", ["--config", str(cfg), "reserve", "gpu:0", "--for", "10m"], env,
               home)
    assert r.returncode == 0, r.stderr
    state = Store(clean.path).read()
    assert [(x.host, x.gpu, x.user) for x in state.reservations] == [("gpu", 0, "gtcarol")]
    # A local writer on the login node sees it and cannot release it as its own.
    with pytest.raises(Exception, match="reserved by gtcarol"):
        release(Store(clean.path), [Target("gpu", 0)])
    r = run_as("gtalice", ["--config", str(cfg), "release", "gpu:0"], env, home)
    assert r.returncode == 0 and "released gpu:0" in r.stdout, r.stderr
    assert Store(clean.path).read().reservations == ()


async def test_board_over_ssh_learns_me_reserves_and_survives_the_host_going_down(
        clean: World) -> None:
    from board_data import NOW, board_config, fixed_snapshots, seed
    from board_pilot import reserve_row

    from gputop.ui.app import GputopApp
    from gputop.ui.widgets import BoardTable

    seed(Store(clean.path))
    cfg = replace(board_config(clean.root), interval=0.5, reservations_path=clean.path,
                  reservations_host="store-as-gtcarol")
    app = GputopApp(cfg, feed=False, clock=lambda: NOW)
    assert app.reservations.store.remote
    async with app.run_test(size=(120, 40)) as pilot:
        for snap in fixed_snapshots():
            app.ingest(snap)
        app.render_board()
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.reservations.me == "gtcarol"  # the store host's login, not this process's root
        assert {r.user for r in app.model.state.reservations} == {"bob", "erin"}
        table = app.query_one(BoardTable)
        await reserve_row(app, pilot)
        mine = [r for r in Store(clean.path).read().reservations if r.user == "gtcarol"]
        assert [(r.host, r.gpu) for r in mine] == [("gpu-h100", 2)]
        rows = table.row_count
        with _store_host_down(clean):
            for _ in range(100):
                await pilot.pause(0.1)
                if app.reservations.problem:
                    break
            problem = app.reservations.problem
            assert problem and "reservations are unknown" in problem
            assert "store-as-gtcarol" in problem
            assert table.row_count == rows and app.is_running  # the GPUs are still shown
        for _ in range(100):  # back on its own once the host answers again
            await pilot.pause(0.1)
            if not app.reservations.problem:
                break
        assert app.reservations.problem is None


def test_run_and_free_over_ssh_hold_and_release_as_the_store_login(clean: World) -> None:
    """``gputop run`` and ``free --reserve`` with the file over SSH: the job's reservation is
    the store login's while it runs, and released when it ends."""
    from fleet import gpu_uuid

    cfg = str(clean.config("gtcarol"))
    env = clean.fleet.env()
    probe = ("import json,sys; from gputop.reservations.store import Store; "
             f"print(json.dumps([(r.user, r.host, r.gpu) for r in Store({str(clean.path)!r})"
             ".read().reservations]))")
    r = subprocess.run([sys.executable, "-m", "gputop", "--config", cfg, "run", "--host", "gpu",
                        "--", "sh", "-c", f'echo "CVD=$CUDA_VISIBLE_DEVICES"; {sys.executable} '
                        f"-c {shlex.quote(probe)}"],
                       capture_output=True, text=True, env=dict(env, PYTHONPATH=str(ROOT)),
                       timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"CVD={gpu_uuid('gpu', 0)}"
    assert json.loads(lines[1]) == [["gtcarol", "gpu", 0]]  # held while the job ran
    assert "released gpu:0" in r.stderr
    assert Store(clean.path).read().reservations == ()
    r = subprocess.run([sys.executable, "-m", "gputop", "--config", cfg, "free", "--reserve"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert [(x.user, x.host) for x in Store(clean.path).read().reservations] == [
        ("gtcarol", r.stdout.split(":")[0].strip())]


def _noop(state: StoreState, now: datetime) -> StoreState:
    return replace(state)


def test_signature_changes_with_the_file(clean: World) -> None:
    st = clean.store("gtcarol")
    assert st.signature() is None
    reserve(Store(clean.path), [Target("gpu", 0)], seconds=600, max_seconds=3600)
    a = st.signature()
    assert a is not None and a[1] == str(clean.path.stat().st_size)
    st.update(_noop)  # nothing changed: nothing written
    assert st.signature() == a
    reserve(st, [Target("gpu", 1)], seconds=600, max_seconds=3600)
    assert st.signature() != a


async def test_an_agent_over_mcp_is_the_store_hosts_login(clean: World) -> None:
    """`gputop mcp` with the file over SSH: the agent reserves, sees and releases as the
    account the store host authenticated (not this process's login, nor $USER)."""
    pytest.importorskip("mcp")
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    env = clean.fleet.env() | {"USER": "mallory", "LOGNAME": "mallory"}
    params = StdioServerParameters(command=sys.executable, env=env, args=[
        "-m", "gputop", "mcp", "--config", str(clean.config("gtcarol", name="agent"))])
    async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
        init = await s.initialize()
        assert "as your user, gtcarol" in (init.instructions or "")

        async def call(name: str, **args: Any) -> dict[str, Any]:
            res = await s.call_tool(name, args)
            assert not res.is_error, res.content
            return json.loads(res.content[0].text)  # type: ignore[union-attr]

        made = await call("reserve", gpus=["gpu:0"], duration="10m")
        assert "for you (gtcarol)" in made["summary"]
        assert [(x.host, x.gpu, x.user) for x in Store(clean.path).read().reservations] == [
            ("gpu", 0, "gtcarol")]
        mine = await call("my_reservations")
        assert [x["gpu"] for x in mine["reservations"]] == ["gpu:0"]
        assert (await call("release", all_mine=True))["released"] == ["gpu:0"]
    assert Store(clean.path).read().reservations == ()


def test_routes_over_ssh_are_the_store_logins_and_only_theirs(clean: World) -> None:
    """A route set through ``HOST:/path`` is the account the store's host authenticated
    (not the local login); another login cannot change or remove it through its store."""
    from gputop.notify.routes import clear_routes, set_route

    carol, dave = clean.store("gtcarol"), clean.store("gtdave")
    try:
        assert set_route(carol, "email", "carol@lab.example").user == "gtcarol"
        set_route(dave, "ntfy", "https://ntfy.sh/dave")
        assert clear_routes(dave) == 1  # only dave's own
        with pytest.raises(StoreError, match="gtdave may not set or remove"):
            dave.update(lambda st, now: replace(st, routes=()))
        assert [(r.user, r.target) for r in carol.read().routes] == [
            ("gtcarol", "carol@lab.example")]
    finally:
        carol.close()
        dave.close()
