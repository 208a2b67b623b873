"""``gputop free`` on a terminal: a small table (GPU, model, free memory, load, and "yours"
where it is free only because you reserved it); in a pipe the ``HOST:GPU`` lines scripts
read, unchanged. ``--count N`` with fewer free says how many there are.

Against the real fleet, on a real pseudo-terminal (gputop decides by ``isatty``)."""

from __future__ import annotations

import errno
import json
import os
import pty
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from gputop.cli.free_table import render
from gputop.model import GpuInfo, MigInstance, utcnow
from gputop.reservations.flags import FreeGpu
from gputop.reservations.records import Reservation
from gputop.reservations.state import StoreState
from tests.support.fleet import Fleet

SGR = re.compile(r"\x1b\[[0-9;]*m")


def run(argv: list[str], env: dict[str, str], *, tty: bool,
        columns: int = 100) -> tuple[int, str, str]:
    """``gputop ARGV`` with stdout on a pseudo-terminal (``tty``) or a pipe."""
    if not tty:
        r = subprocess.run([sys.executable, "-m", "gputop", *argv], env=env, text=True,
                           capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
        return r.returncode, r.stdout, r.stderr
    master, slave = pty.openpty()
    import fcntl
    import struct
    import termios

    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    p = subprocess.Popen([sys.executable, "-m", "gputop", *argv], env=env, stdout=slave,
                         stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    os.close(slave)
    out = b""
    while True:  # drain while it runs (a full pty would block it), until it closes
        try:
            chunk = os.read(master, 65536)
        except OSError as exc:
            if exc.errno != errno.EIO:
                raise
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert p.stderr is not None
    err = p.stderr.read().decode()
    return p.wait(timeout=120), out.decode().replace("\r\n", "\n"), err


@pytest.fixture(scope="module")
def team(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], Path]:
    """The fleet's healthy hosts, with an own reservations file."""
    tmp = tmp_path_factory.mktemp("free-table")
    cfg = tmp / "hosts.toml"
    text = fleet.write_config(["gpu-h100", "gpu-mixed", "gpu-lost"], timeout=20.0).read_text()
    cfg.write_text(text.replace(str(fleet.root / "reservations.json"), str(tmp / "res.json")))
    env = fleet.env() | {"TZ": "UTC", "GPUTOP_CONFIG": str(cfg)}
    env.pop("NO_COLOR", None)
    env.pop("COLUMNS", None)
    return env, tmp / "res.json"


def rows(out: str) -> list[list[str]]:
    return [re.split(r"\s{2,}", SGR.sub("", line).strip()) for line in out.splitlines()]


def test_a_terminal_gets_a_table_and_a_pipe_host_gpu_lines(team: tuple[dict[str, str], Path]
                                                           ) -> None:
    env, res = team
    res.unlink(missing_ok=True)
    code, out, err = run(["free", "--whole"], env, tty=True)
    assert code == 0, err
    assert "\x1b[" in out  # colour on a terminal
    # gpu-mixed:2 is the fleet's one idle, unreserved GPU: RTX 2080 SUPER, 211 MiB used of 8 GiB
    assert rows(out)[0] == ["GPU", "MODEL", "FREE", "LOAD", "RESERVED"]
    (row,) = rows(out)[1:]
    assert row[0] == "gpu-mixed:2" and "RTX 2080 SUPER" in row[1] and row[4] == "-"
    assert re.fullmatch(r"\d+\.\dG of \d+G", row[2]) and re.fullmatch(r"\d+%", row[3]), row
    assert run(["free", "--whole"], env, tty=False)[1] == "gpu-mixed:2\n"
    assert run(["free", "--whole"], env | {"NO_COLOR": "1"}, tty=True)[1].count("\x1b[") == 0


def test_your_own_reservation_says_so(team: tuple[dict[str, str], Path]) -> None:
    env, res = team
    res.unlink(missing_ok=True)
    r = subprocess.run([sys.executable, "-m", "gputop", "reserve", "gpu-mixed:2", "--for", "2h"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    code, out, err = run(["free", "--whole"], env, tty=True)
    assert code == 0, err
    (row,) = rows(out)[1:]
    assert row[0] == "gpu-mixed:2" and re.fullmatch(r"yours, (2h00m|1h5\dm) left", row[4]), row
    assert run(["free", "--whole"], env, tty=False)[1] == "gpu-mixed:2\n"  # scripts: unchanged


def test_fewer_than_count_shows_those_found_and_says_how_many(
        team: tuple[dict[str, str], Path]) -> None:
    env, res = team
    res.unlink(missing_ok=True)
    code, out, err = run(["free", "--whole", "--count", "20"], env, tty=True)
    assert code == 1
    assert [r[0] for r in rows(out)] == ["GPU", "gpu-mixed:2"]
    assert "1 free, 20 wanted" in err
    code, out, err = run(["free", "--whole", "--count", "20"], env, tty=False)
    assert (code, out) == (1, "")  # a script asking for 20 gets none or all
    assert "1 free, 20 wanted" in err
    code, out, _ = run(["free", "--whole", "--count", "20", "--json"], env, tty=True)
    assert code == 1 and json.loads(out)["free"] == []



def test_fewer_than_count_names_the_hosts_that_did_not_answer(
        team: tuple[dict[str, str], Path], fleet: Fleet, tmp_path: Path) -> None:
    """A host that is down may be why too few are free: `free` names it and its error kind
    (and where to read why) instead of only suggesting --wait, which could wait for good."""
    env, res = team
    res.unlink(missing_ok=True)
    cfg = tmp_path / "hosts.toml"
    cfg.write_text(Path(env["GPUTOP_CONFIG"]).read_text()
                   + '[[hosts]]\nname = "unreachable"\n\n[[hosts]]\nname = "auth"\n')
    code, _, err = run(["free", "--whole", "--count", "20"], env | {"GPUTOP_CONFIG": str(cfg)},
                       tty=False)
    assert code == 1
    assert "1 free, 20 wanted" in err
    assert ("2 of 5 host(s) did not answer: unreachable (unreachable), auth (auth) "
            "(gputop --once says why)") in err, err
    code, _, err = run(["run", "--count", "2", "--", "true"], env | {"GPUTOP_CONFIG": str(cfg)},
                       tty=False)
    assert code == 1 and "not 2 free GPU(s) on one host" in err, err
    assert "2 of 5 host(s) did not answer: unreachable (unreachable), auth (auth)" in err, err
    code, _, err = run(["free", "--whole", "--count", "20"], env, tty=False)
    assert code == 1 and "did not answer" not in err  # all answered: nothing to name
    # None of the hosts asked answered: not "0 free" (nothing is known), exit 3, and why.
    for args in (["free", "--host", "auth"], ["free", "--host", "auth", "--json"],
                 ["free", "--host", "auth", "--share", "1G"],
                 ["run", "--host", "auth", "--", "true"],
                 ["run", "--host", "auth", "--share", "1G", "--", "true"]):
        code, out, err = run(args, env | {"GPUTOP_CONFIG": str(cfg)}, tty=False)
        assert code == 3, (args, err)
        assert err == ("gputop: no host answered (auth: auth), so nothing is known to be "
                       "free (gputop --once says why)\n"), err
        assert out == ('{"version":1,"free":[]}\n' if "--json" in args else "")

def test_mig_instances_show_their_profile_and_no_load(team: tuple[dict[str, str], Path]) -> None:
    env, res = team
    res.unlink(missing_ok=True)
    code, out, err = run(["free", "--count", "2"], env, tty=True, columns=200)
    assert code == 0, err
    found = rows(out)[1:]
    inst = [r for r in found if "/" in r[0]]
    assert inst and all(r[3] == "n/a" and re.search(r"\dg\.\d+gb", r[1]) for r in inst), found


# --- the renderer alone: hostile names, narrow terminals ----------------------------------

def _free(name: str, *, instance: MigInstance | None = None) -> FreeGpu:
    g = GpuInfo(index=3, uuid="GPU-1", name=name, utilization_percent=0,
                memory_used_mib=1024, memory_total_mib=81920, instances=(
                    (instance,) if instance else ()))
    return FreeGpu("atlas", g, instance)


def test_hostile_names_are_cleaned_and_cut_with_an_ellipsis() -> None:
    now = utcnow()
    out = render([_free("NVIDIA \x1b[31mH100\x1b]0;owned\x07 80GB\u202e HBM3 " + "x" * 80)],
                 None, now, width=60)
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    lines = out.splitlines()
    assert all(len(line) <= 60 for line in lines), lines
    assert "…" in lines[1] and lines[1].startswith("atlas:3  H100")


def test_an_instance_under_your_whole_gpu_reservation() -> None:
    now = utcnow()
    inst = MigInstance(gpu_instance_id=2, profile="3g.40gb", memory_used_mib=0,
                       memory_total_mib=40960)
    mine = Reservation("r1", "atlas", 3, "me", "m", now, now + timedelta(hours=1, minutes=1))
    out = render([_free("NVIDIA H100 80GB HBM3", instance=inst)], StoreState((mine,)), now)
    assert rows(out)[1] == ["atlas:3/2", "H100 80GB HBM3 3g.40gb", "40.0G of 40G", "n/a",
                            "yours (whole GPU), 1h01m left"]
