"""The board in a real terminal (a tmux pane): SIGTERM, SIGHUP, SIGINT and ctrl+c end it
with the terminal restored (normal screen, no mouse tracking, same tty modes) and the
demo's temporary folder removed; the exit code is 128 + the signal."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


class Pane:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.socket = root / "tmux.sock"

    def tmux(self, *args: str) -> str:
        r = subprocess.run(["tmux", "-S", str(self.socket), *args], capture_output=True,
                           text=True, timeout=20)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def flags(self) -> dict[str, str]:
        names = ("alternate_on", "mouse_any_flag", "mouse_button_flag", "mouse_standard_flag",
                 "mouse_sgr_flag")
        out = self.tmux("display-message", "-p", "-t", "t", " ".join(f"#{{{n}}}" for n in names))
        return dict(zip(names, out.split()))


def open_pane(tmp_path: Path, args: str, **extra: str) -> Pane:
    """``gputop ARGS`` in a detached 120x40 tmux pane; its exit code lands in ``rc``."""
    p = Pane(tmp_path)
    (tmp_path / "tmp").mkdir()
    env = {"TMPDIR": str(tmp_path / "tmp"), "TERM": "xterm-256color",
           "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "XDG_DATA_HOME": str(tmp_path / "data"),
           "PYTHONPATH": os.environ.get("PYTHONPATH", ""), **extra}
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    script = (f"export {exports}; stty -g > before; "
              f"{shlex.quote(sys.executable)} -m gputop {args}; echo $? > rc; "
              "stty -g > after; exec sleep 600")
    p.tmux("-f", "/dev/null", "new-session", "-d", "-s", "t", "-x", "120", "-y", "40",
           "-c", str(tmp_path), "sh", "-c", script)
    return p


@pytest.fixture
def pane(tmp_path: Path) -> Iterator[Pane]:
    p = open_pane(tmp_path, "--demo")
    yield p
    subprocess.run(["tmux", "-S", str(p.socket), "kill-server"], capture_output=True)


def wait_for(check: object, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


def board_pid(pane: Pane) -> int:
    shell = int(pane.tmux("display-message", "-p", "-t", "t", "#{pane_pid}"))
    kids = Path(f"/proc/{shell}/task/{shell}/children").read_text().split()
    assert kids, "gputop is not running in the pane"
    return int(kids[0])


@pytest.mark.parametrize("how", ["TERM", "HUP", "INT", "ctrl+c"])
def test_board_ends_cleanly(pane: Pane, how: str) -> None:
    assert wait_for(lambda: "atlas" in pane.tmux("capture-pane", "-p", "-t", "t"), 60), \
        pane.tmux("capture-pane", "-p", "-t", "t")
    assert wait_for(lambda: pane.flags()["alternate_on"] == "1", 10)
    if how == "ctrl+c":
        pane.tmux("send-keys", "-t", "t", "C-c")
        code = 128 + signal.SIGINT
    else:
        sig = getattr(signal, f"SIG{how}")
        os.kill(board_pid(pane), sig)
        code = 128 + sig
    rc = pane.root / "rc"
    after = pane.root / "after"  # (the shell creates it before stty has written to it)
    assert wait_for(lambda: after.exists() and after.read_text().endswith("\n"), 20), \
        screen(pane)
    assert int(rc.read_text()) == code, screen(pane)
    assert (pane.root / "after").read_text() == (pane.root / "before").read_text()  # tty modes
    assert set(pane.flags().values()) == {"0"}, pane.flags()  # normal screen, no mouse
    assert os.listdir(pane.root / "tmp") == []  # the demo's folder is gone
    assert "Traceback" not in screen(pane)


def screen(pane: Pane) -> str:
    return pane.tmux("capture-pane", "-p", "-t", "t")


def test_sigterm_leaves_no_refresh_running_on_a_host(tmp_path: Path) -> None:
    """The board on real sshd hosts, one of them hung: after SIGTERM nothing of gputop's
    is left running there."""
    from tests.support.fleet import Fleet, Host
    from tests.support.shared_fleet import need_sshd, world_readable

    need_sshd()
    (tmp_path / "fleet").mkdir()
    fleet = Fleet(world_readable(tmp_path / "fleet"), [
        Host("ok", "127.0.4.2"), Host("hang", "127.0.4.3", scenario="hang")]).start()
    p: Pane | None = None
    try:
        cfg = fleet.write_config(timeout=60.0, interval=1.0)
        p = open_pane(tmp_path, f"--config {shlex.quote(str(cfg))}", HOME=str(fleet.home))
        hang = fleet.hosts["hang"]
        assert wait_for(lambda: fleet.remote_processes(hang), 60), screen(p)
        os.kill(board_pid(p), signal.SIGTERM)
        assert wait_for(lambda: (p.root / "after").exists(), 20), screen(p)
        assert int((p.root / "rc").read_text()) == 128 + signal.SIGTERM
        assert not fleet.remote_processes(hang)
        assert set(p.flags().values()) == {"0"}
    finally:
        if p is not None:
            subprocess.run(["tmux", "-S", str(p.socket), "kill-server"], capture_output=True)
        fleet.stop()


def test_a_board_wedged_after_a_signal_still_exits(tmp_path: Path) -> None:
    """A terminal closed under load can wedge Textual's shutdown (its writer thread blocks);
    the watchdog armed by the first signal ends the process anyway, with 128 + the signal.
    Here the wedge is a real one of the same kind: a put on a full queue that nobody reads."""
    script = (
        "import queue, signal\n"
        "from gputop.ui.app import GputopApp, arm_exit_watchdog\n"
        "arm_exit_watchdog(128 + signal.SIGHUP, after=0.5)\n"
        "q = queue.Queue(maxsize=1); q.put(1); q.put(2)  # blocks forever\n"
    )
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 128 + signal.SIGHUP, r.stderr
    assert time.monotonic() - started < 30


async def test_the_first_signal_arms_the_watchdog(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from gputop.ui import app as app_module
    from tests.support.board_data import board_config

    armed: list[int] = []
    monkeypatch.setattr(app_module, "arm_exit_watchdog",
                        lambda code: armed.append(code) or threading.Timer(0, lambda: None))
    board = app_module.GputopApp(board_config(tmp_path), sources=[], feed=False)
    async with board.run_test() as pilot:
        board._on_signal(signal.SIGHUP)
        board._on_signal(signal.SIGHUP)  # a second signal arms nothing more
        await pilot.pause()
    assert armed == [128 + signal.SIGHUP] and board.return_code == 129
