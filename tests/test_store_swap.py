"""A hostile teammate against the shared file's two writers (local and over SSH): a member
of the team's group, who can rename any name in the shared directory, races every writer
for its temp names, and plants FIFOs and sockets at the store's names. The victim's other
files stay untouched, the shared file stays a plain file, and nothing hangs or is left
running on the store's host."""

from __future__ import annotations

import contextlib
import grp
import multiprocessing
import os
import pwd
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from pathlib import Path

import pytest

from gputop.reservations.filelock import StoreError
from gputop.reservations.ops import reserve
from gputop.reservations.remote import RemoteStore
from gputop.reservations.store import SWEEP_MAX, ReservationStore, Store
from gputop.reservations.terms import Target
from tests.support.fleet import TEAM_GROUP, Fleet, Host, ensure_login_users, is_root, sshd_available
from tests.test_remote_store import World, _alias, _script_pids, _under

STORE_IP = "127.0.61.2"
ATTACKER = "gtdave"  # a member of the team's group
VICTIM = "gtcarol"  # the remote writer's login
PREFIX = ".reservations.json.tmp."
SECRET = b"the victim's own file\n"


def _swap(team: str, victim: str, stop: Event, seen: Synchronized) -> None:  # type: ignore[type-arg]
    """The attacker, as ``ATTACKER``: whatever temp name appears, a symbolic link to the
    victim's file is renamed over it; a directory is renamed away first and a link to the
    attacker's own (world-writable) directory put in its place, holding a link to the victim's
    file under the name a writer would create."""
    pw = pwd.getpwnam(ATTACKER)
    os.setgroups([grp.getgrnam(TEAM_GROUP).gr_gid])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
    trap = os.path.join(team, "trap")
    os.mkdir(trap)
    os.chmod(trap, 0o777)
    os.symlink(victim, os.path.join(trap, "gputop-new-file"))
    n = 0
    while not stop.is_set():
        for name in os.listdir(team):
            if not name.startswith(PREFIX):
                continue
            n += 1
            path, link = os.path.join(team, name), os.path.join(team, f"link{n}")
            with contextlib.suppress(OSError):
                seen.value += 1
                os.symlink(victim, link)
                try:
                    os.rename(link, path)
                except OSError:
                    os.unlink(link)
                    os.rename(path, os.path.join(team, f"moved{n}"))
                    os.symlink(trap, link)
                    os.rename(link, path)


@contextlib.contextmanager
def _attacker(team: Path, victim: Path) -> Iterator[Synchronized]:  # type: ignore[type-arg]
    ctx = multiprocessing.get_context("fork")
    stop, seen = ctx.Event(), ctx.Value("i", 0)
    child = ctx.Process(target=_swap, args=(str(team), str(victim), stop, seen))
    child.start()
    try:
        deadline = time.monotonic() + 10
        while not (team / "trap").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        yield seen
    finally:
        stop.set()
        child.join(10)
        if child.is_alive():
            child.kill()


def _team(root: Path) -> Path:
    team = root / "team"
    team.mkdir()
    os.chown(team, 0, grp.getgrnam(TEAM_GROUP).gr_gid)
    team.chmod(0o2775)  # a team's shared directory: setgid, group-writable, no sticky bit
    return team


def _victim_file(root: Path, owner: str) -> Path:
    """A file of the victim's, in a directory only they can write."""
    pw = pwd.getpwnam(owner)
    private = root / f"private-{owner}"
    private.mkdir(mode=0o700)
    secret = private / "secret"
    secret.write_bytes(SECRET)
    for p in (private, secret):
        os.chown(p, pw.pw_uid, pw.pw_gid)
    return secret


def _race(store: Callable[[], ReservationStore], team: Path, victim: Path, user: str) -> None:
    """Reserves while the attacker swaps; then the checks every writer must pass."""
    made: set[int] = set()
    refused: list[str] = []
    with _attacker(team, victim) as seen:
        st = store()
        for gpu in range(24):
            try:
                reserve(st, [Target("gpu", gpu)], seconds=600, max_seconds=3600)
            except StoreError as exc:
                refused.append(str(exc))
            else:
                made.add(gpu)
        assert seen.value > 0  # the race was run: the attacker saw temp names
    assert victim.read_bytes() == SECRET
    path = team / "reservations.json"
    assert path.is_file() and not path.is_symlink()
    # A write the attacker got in the way of is refused, and says why.
    assert all("was replaced while it wrote" in m for m in refused), refused
    assert {(r.gpu, r.user) for r in Store(path).read().reservations} == {
        (g, user) for g in made}
    assert made  # the attacker cannot stop every write
    reserve(store(), [Target("gpu", 99)], seconds=600, max_seconds=3600)  # and later ones
    assert 99 in {r.gpu for r in Store(path).read().reservations}
    assert victim.read_bytes() == SECRET


@pytest.fixture
def shared() -> Iterator[Path]:
    if not is_root():
        pytest.skip("needs root to become the attacker")
    ensure_login_users()
    d = Path(tempfile.mkdtemp(prefix="gputop-swap-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_teammate_swapping_links_over_temp_names_cannot_turn_a_local_writer(
        shared: Path) -> None:
    team = _team(shared)
    victim = _victim_file(shared, "root")
    _race(lambda: Store(team / "reservations.json"), team, victim, "root")


def test_a_directory_renamed_to_a_temp_name_keeps_what_it_holds(tmp_path: Path) -> None:
    """Leftovers of a killed writer are removed, never recursively: a directory of yours
    that a teammate renamed to a temp name loses nothing of yours."""
    path = tmp_path / "reservations.json"
    reserve(Store(path), [Target("gpu", 0)], seconds=600, max_seconds=3600)
    mine = tmp_path / f"{PREFIX}{os.geteuid()}.1.abc"
    mine.mkdir(mode=0o700)
    (mine / "work.txt").write_text("keep")
    left = tmp_path / f"{PREFIX}{os.geteuid()}.2.def"  # a killed writer's: its one file
    left.mkdir(mode=0o700)
    (left / "gputop-new-file").write_text("{}")
    reserve(Store(path), [Target("gpu", 1)], seconds=600, max_seconds=3600)
    assert (mine / "work.txt").read_text() == "keep"
    assert not left.exists()


PLANTED = 30_000


def _fill(team: str, victim_uid: int) -> None:
    """As ``ATTACKER``: ``PLANTED`` non-empty directories at temp names, half of them
    named with the victim's uid (which the victim cannot remove: not theirs)."""
    pw = pwd.getpwnam(ATTACKER)
    os.setgroups([grp.getgrnam(TEAM_GROUP).gr_gid])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
    for i in range(PLANTED):
        name = os.path.join(team, f"{PREFIX}{victim_uid if i % 2 else 'c'}.{i}")
        os.mkdir(name)
        os.close(os.open(os.path.join(name, "gputop-new-file"), os.O_CREAT | os.O_WRONLY))
    os._exit(0)


def _planted(team: Path, victim: str) -> Path:
    """``team`` filled by the attacker, and a killed writer's leftover of the victim's own
    (its private directory and file): the one name a write of theirs removes."""
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_fill, args=(str(team), pwd.getpwnam(victim).pw_uid))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    pw = pwd.getpwnam(victim)
    left = team / f"{PREFIX}{pw.pw_uid}.1.dead"
    left.mkdir(mode=0o700)
    (left / "gputop-new-file").write_text("{}")
    for p in (left, left / "gputop-new-file"):
        os.chown(p, pw.pw_uid, pw.pw_gid)
    return left


def _swept(team: Path, left: Path) -> None:
    assert not left.exists()  # the victim's own leftover went
    assert sum(1 for n in os.listdir(team) if n.startswith(PREFIX)) == PLANTED


@pytest.fixture
def flooded() -> Iterator[Path]:
    """A team directory on tmpfs where there is one (30,000 directories made on a loaded
    disk take a minute; the writers' work is the same there)."""
    if not is_root():
        pytest.skip("needs root to become the attacker")
    ensure_login_users()
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    d = Path(tempfile.mkdtemp(prefix="gputop-flood-", dir=base))
    d.chmod(0o755)
    try:
        yield _team(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_local_write_passes_over_a_teammates_planted_temp_names(flooded: Path) -> None:
    """Thousands of non-empty directories at temp names, the victim's uid in half of them:
    the write opens none of them (it held the lock for most of its 15 s and writers queued
    behind it failed), removes its own leftover, and at most ``SWEEP_MAX`` of its own a
    write (the rest go with later writes)."""
    left = _planted(flooded, "root")
    path = flooded / "reservations.json"
    started = time.monotonic()
    reserve(Store(path), [Target("gpu", 0)], seconds=600, max_seconds=3600)
    assert time.monotonic() - started < 5  # far inside the lock's 15 s
    assert [r.gpu for r in Store(path).read().reservations] == [0]
    _swept(flooded, left)
    many = [flooded / f"{PREFIX}{os.geteuid()}.{i}.dead" for i in range(SWEEP_MAX + 10)]
    for p in many:
        p.mkdir(mode=0o700)
        (p / "gputop-new-file").write_text("{}")
    Store(path).update(lambda s, now: s)
    assert sum(p.exists() for p in many) == 10
    Store(path).update(lambda s, now: s)
    assert not any(p.exists() for p in many)


def _plant(path: Path, kind: str) -> socket.socket | None:
    """A FIFO or a listening socket at ``path``, which everyone may open or connect to."""
    s = None
    if kind == "fifo":
        os.mkfifo(path)
    else:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.listen(1)
    path.chmod(0o666)
    return s


@pytest.mark.parametrize("kind", ["fifo", "socket"])
@pytest.mark.parametrize("name", ["reservations.json.lock", "reservations.json.flock",
                                  "reservations.json"])
def test_a_fifo_or_socket_at_a_local_stores_name_is_refused_at_once(
        tmp_path: Path, name: str, kind: str) -> None:
    planted = _plant(tmp_path / name, kind)
    try:
        with pytest.raises(StoreError, match="not a regular file"):
            reserve(Store(tmp_path / "reservations.json"), [Target("gpu", 0)], seconds=60,
                    max_seconds=3600)
        assert not (tmp_path / "reservations.json").is_file()
    finally:
        if planted is not None:
            planted.close()


# --- over SSH -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    if sshd_available() or not is_root() or shutil.which("flock") is None:
        pytest.skip("needs sshd, root (for the login users) and flock(1)")
    if VICTIM not in ensure_login_users():
        pytest.skip("needs the SSH login users")
    root = Path(tempfile.mkdtemp(prefix="gputop-swap-remote-", dir="/tmp"))
    root.chmod(0o755)
    fleet = Fleet(root, [Host("store", STORE_IP)]).start()
    try:
        with (fleet.ssh / "config").open("a") as f:
            f.write("\n" + _alias(fleet, f"store-as-{VICTIM}", "store", VICTIM))
        w = World(fleet, root)
        _team(root)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("HOME", str(fleet.home))
            mp.delenv("SSH_AUTH_SOCK", raising=False)
            mp.delenv("GPUTOP_RESERVATIONS", raising=False)
            yield w
    finally:
        fleet.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def clean(world: World) -> World:
    for p in world.team.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    for p in world.root.glob("private-*"):
        shutil.rmtree(p)
    return world


def test_a_teammate_swapping_links_over_temp_names_cannot_turn_a_remote_writer(
        clean: World) -> None:
    victim = _victim_file(clean.root, VICTIM)
    stores: list[RemoteStore] = []

    def store() -> ReservationStore:
        stores.append(clean.store(VICTIM))
        return stores[-1]

    try:
        _race(store, clean.team, victim, VICTIM)
    finally:
        for st in stores:
            st.close()
    _no_writer_left(clean.root)


def test_a_remote_write_passes_over_a_teammates_planted_temp_names(
        clean: World, flooded: Path) -> None:
    """Over SSH: the script forks nothing for a teammate's names and sweeps after its first
    marker, so the write ends within its deadline (it used to answer nothing in time),
    and its own leftover still goes."""
    left = _planted(flooded, VICTIM)
    path = flooded / "reservations.json"
    st = clean.store(VICTIM, path)
    try:
        reserve(st, [Target("gpu", 0)], seconds=600, max_seconds=3600)
    finally:
        st.close()
    assert [(r.gpu, r.user) for r in Store(path).read().reservations] == [(0, VICTIM)]
    _swept(flooded, left)
    _no_writer_left(clean.root)


def _no_writer_left(root: Path) -> None:
    deadline = time.monotonic() + 5
    while _script_pids(VICTIM, root) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _script_pids(VICTIM, root) == []  # no writer shell left on the host


@pytest.mark.parametrize("kind", ["fifo", "socket"])
@pytest.mark.parametrize("name, says", [
    ("reservations.json.flock", "lock file .* is not a regular file"),
    ("reservations.json", "not a regular file on"),
])
def test_a_fifo_or_socket_at_a_remote_stores_name_is_refused_at_once(
        clean: World, name: str, says: str, kind: str) -> None:
    planted = _plant(clean.team / name, kind)
    st = clean.store(VICTIM)
    try:
        with pytest.raises(StoreError, match=says):
            st.update(lambda s, now: s, timeout=3)
        with pytest.raises(StoreError, match=says):  # and again: nothing was left holding it
            st.update(lambda s, now: s, timeout=3)
    finally:
        st.close()
        if planted is not None:
            planted.close()
    _no_writer_left(clean.root)


def _flip(path: str, sources: list[str], stop: Event) -> None:
    """Each of ``sources`` hard-linked in turn over ``path``, as fast as it goes."""
    tmp = path + ".flip"
    while not stop.is_set():
        for src in sources:
            with contextlib.suppress(FileExistsError):
                os.link(src, tmp)
            os.rename(tmp, path)


@pytest.mark.xfail(strict=False, reason=(
    "not fixed: a FIFO the reader may not write (mode 0644), swapped in between its type "
    "check and its read-only open, holds that open; on an idle machine the swapper wins "
    "often, the held readers fill the connection's sessions and reads fail"))
def test_a_fifo_swapped_in_while_reading_over_ssh_never_holds_the_reader(
        clean: World) -> None:
    """Two versions of the file and a FIFO renamed in turn over the path while a reader
    asks: each answer is a version or "not a regular file", never a reader waiting on the
    FIFO (the sum and the bytes are one file's)."""
    reserve(Store(clean.path), [Target("gpu", 0)], seconds=600, max_seconds=3600)
    one, two, fifo = clean.team / "one", clean.team / "two", clean.team / "fifo"
    os.link(clean.path, one)
    reserve(Store(clean.path), [Target("gpu", 1)], seconds=600, max_seconds=3600)
    os.link(clean.path, two)
    os.mkfifo(fifo)
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    swapper = ctx.Process(target=_flip, args=(str(clean.path), [str(fifo), str(one),
                                                                str(fifo), str(two)], stop))
    st = clean.store(VICTIM, timeout=2)
    answers: set[str] = set()
    swapper.start()
    try:
        for _ in range(150):
            try:
                answers.add(str(sorted(r.gpu for r in st.read().reservations)))
            except StoreError as exc:
                # (on a loaded machine a read may also outlast the 2 s timeout: that
                # reader is replaced; none may be left waiting, checked below)
                assert re.search("not a regular file|was replaced while|connection dropped",
                                 str(exc)), exc
                answers.add("refused")
    finally:
        stop.set()
        swapper.join(10)
        st.close()
    assert answers & {"[0]", "[0, 1]"}  # and the file is read whenever it is there
    deadline = time.monotonic() + 5
    while _reader_pids(clean.root) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _reader_pids(clean.root) == []


def _reader_pids(root: Path) -> list[int]:
    """``VICTIM``'s reader scripts under this fleet's sshd."""
    uid = pwd.getpwnam(VICTIM).pw_uid
    out = []
    for d in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if d.name.isdigit() and d.stat().st_uid == uid \
                    and b"cksum" in (d / "cmdline").read_bytes() \
                    and _under(int(d.name), str(root).encode()):
                out.append(int(d.name))
    return out
