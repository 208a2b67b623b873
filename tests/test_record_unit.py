"""``gputop record --print-unit``: the shipped systemd user unit, with ``ExecStart`` running
the gputop that printed it, which copying the file needed a ``python3`` that can import
gputop for (a pipx or venv install has none). Paths with spaces, ``%`` and ``$`` stay whole:
``systemd-analyze verify`` (where installed) finds the program."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gputop.errors import UsageError
from gputop.history.unit import exec_word, unit_text

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "gputop"  # this venv's console script


def exec_start(unit: str) -> str:
    (line,) = [x for x in unit.splitlines() if x.startswith("ExecStart=")]
    return line.removeprefix("ExecStart=")


def print_unit(argv: list[str], cwd: Path, path: str | None = None) -> str:
    env = {**os.environ, "PATH": f"{path}:{os.environ['PATH']}" if path else os.environ["PATH"]}
    env.pop("GPUTOP_CONFIG", None)
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def odd_install(tmp_path: Path) -> tuple[Path, Path]:
    """This venv's gputop copied into a directory whose name holds a space, a systemd
    specifier and a variable, with a config beside it: (the directory, the config)."""
    odd = tmp_path / "my tools %h $HOME"
    odd.mkdir()
    shutil.copy2(SCRIPT, odd / "gputop")
    cfg = odd / "team hosts.toml"
    cfg.write_text('hosts = ["gpu-01"]\n')
    return odd, cfg


def expected_exec(odd: Path, cmd: str, cfg: Path, rest: str) -> str:
    """The ExecStart that runs ``odd``'s gputop ``cmd`` on ``cfg`` (quoted for systemd)."""
    return (f'"{odd}/gputop"'.replace("%", "%%") + f" {cmd} --config "
            + f'"{cfg}"'.replace("%", "%%").replace("$", "$$") + f" {rest}")


@pytest.mark.skipif(not SCRIPT.exists(), reason="no gputop console script in this venv")
def test_the_unit_runs_the_gputop_that_printed_it(tmp_path: Path) -> None:
    odd, cfg = odd_install(tmp_path)
    unit = print_unit(["gputop", "record", "--print-unit", "--config", cfg.name,
                       "--interval", "5"], cwd=odd, path=str(odd))
    assert exec_start(unit) == expected_exec(odd, "record", cfg, "--interval 5")
    assert "systemctl --user enable --now gputop-record" in unit and "python3 -c" not in unit
    assert "WantedBy=default.target" in unit and "RestartPreventExitStatus=2" in unit
    if shutil.which("systemd-analyze"):
        (tmp_path / "gputop-record.service").write_text(unit)
        r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "gputop-record.service")],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr  # it checks the program is executable
    r = subprocess.run([str(odd / "gputop"), "record", "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "--print-unit" in r.stdout


def test_python_m_gputop_gets_this_interpreter(tmp_path: Path) -> None:
    unit = print_unit([sys.executable, "-m", "gputop", "record", "--print-unit"], cwd=ROOT)
    assert exec_start(unit).startswith(f"{exec_word(sys.executable, program=True)} -m gputop "
                                       "record")


def test_words_are_escaped_for_systemd() -> None:
    assert exec_word("/usr/bin/gputop", program=True) == "/usr/bin/gputop"
    assert exec_word("a b") == '"a b"'
    assert exec_word('say "hi"\\') == '"say \\"hi\\"\\\\"'
    assert exec_word("50%") == "50%%" and exec_word("$x") == "$$x"
    assert exec_word("/opt/$x/gputop", program=True) == "/opt/$x/gputop"  # no variables there
    assert exec_word("") == '""'
    with pytest.raises(UsageError, match="control character"):
        exec_word("/tmp/x\nExecStartPre=/bin/evil")
    assert exec_start(unit_text(["/x/gputop", "record"])) == "/x/gputop record"


@pytest.mark.skipif(not SCRIPT.exists(), reason="no gputop console script in this venv")
def test_the_hub_unit_runs_the_gputop_that_printed_it(tmp_path: Path) -> None:
    """``gputop serve --print-unit``: the shipped hub unit once said to copy it out with a
    ``python3 -c 'import gputop.hub'`` (which a pipx or venv install cannot) and ran
    ``gputop serve`` with no ``--config`` (a unit reads no ``~/.bashrc``: the team's
    ``$GPUTOP_CONFIG`` never reached it)."""
    odd, cfg = odd_install(tmp_path)
    unit = print_unit(["gputop", "serve", "--print-unit", "--config", cfg.name,
                       "--listen", "127.0.0.1:9911"], cwd=odd, path=str(odd))
    assert exec_start(unit) == expected_exec(odd, "serve", cfg, "--listen 127.0.0.1:9911")
    assert "gputop serve --print-unit > ~/.config/systemd/user/gputop-hub.service" in unit
    assert "python3 -c" not in unit and "Written by `gputop serve --print-unit`" in unit
    assert "RestartPreventExitStatus=2" in unit and "WantedBy=default.target" in unit
    if shutil.which("systemd-analyze"):
        (tmp_path / "gputop-hub.service").write_text(unit)
        r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "gputop-hub.service")],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
    env = {**os.environ, "GPUTOP_CONFIG": str(cfg)}  # what ~/.bashrc exports, absolute
    r = subprocess.run([str(odd / "gputop"), "serve", "--print-unit"], capture_output=True,
                       text=True, timeout=60, env=env, cwd=tmp_path)
    assert r.returncode == 0 and " serve --config " in exec_start(r.stdout), r.stderr
    r = subprocess.run([str(odd / "gputop"), "serve", "--print-unit", "--listen", "x"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and not r.stdout and "--listen" in r.stderr
