"""Shell completion: the bash script, run by a real bash, completes subcommands, options,
host names and ``HOST:GPU`` from the config (calling back into gputop); zsh and fish
scripts at least parse where those shells are installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gputop.reservations.ops import Target, reserve
from gputop.reservations.store import Store


@pytest.fixture
def setup(tmp_path: Path) -> dict[str, str]:
    """A ``gputop`` on PATH (this interpreter), a config with three hosts, reservations."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "gputop"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} -m gputop \"$@\"\n")
    exe.chmod(0o755)
    cfg = tmp_path / "hosts.toml"
    res = tmp_path / "res.json"
    cfg.write_text(f'hosts = ["gpu-01", "gpu-02", "dgx-a"]\n[reservations]\npath = "{res}"\n')
    store = Store(res)
    reserve(store, [Target("gpu-02", 3)], seconds=3600, max_seconds=86400, note="")
    reserve(store, [Target("gone-host", 1)], seconds=3600, max_seconds=86400, note="")
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "GPUTOP_CONFIG": str(cfg)}
    env["SCRIPT"] = subprocess.run([str(exe), "completion", "bash"], env=env,
                                   capture_output=True, text=True, check=True).stdout
    return env


def complete(env: dict[str, str], line: str) -> list[str]:
    """What bash offers for ``line`` (the cursor at its end), as readline would split it."""
    code = r'''
eval "$SCRIPT"
COMP_LINE="$LINE"; COMP_POINT=${#COMP_LINE}
read -ra COMP_WORDS <<< "$(printf '%s' "$LINE" | sed 's/:/ : /g')"
[[ "$LINE" == *" " ]] && COMP_WORDS+=("")
COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
_gputop gputop "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"
for w in "${COMPREPLY[@]}"; do printf '<%s>\n' "$w"; done
'''
    r = subprocess.run(["bash", "-c", code], env={**env, "LINE": line}, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return sorted(x[1:-1] for x in r.stdout.splitlines())  # a blank offer stays visible


def test_subcommands_and_options(setup: dict[str, str]) -> None:
    assert complete(setup, "gputop re") == ["record", "release", "report", "reservations",
                                            "reserve"]
    assert "init-config" in complete(setup, "gputop ")
    assert "--once" in complete(setup, "gputop --")
    assert complete(setup, "gputop reserve gpu-01:0 --f") == ["--for"]
    assert "--config" in complete(setup, "gputop reserve gpu-01:0 --")
    # --theme is the board's: offered before any subcommand, never after one
    assert "--theme" in complete(setup, "gputop --")
    assert "--theme" not in complete(setup, "gputop reserve gpu-01:0 --")
    assert complete(setup, "gputop report --in") == []  # report does not loop: no --interval
    assert complete(setup, "gputop --theme gputop-l") == ["gputop-light"]


def test_reserve_completes_hosts_from_the_config(setup: dict[str, str]) -> None:
    assert complete(setup, "gputop reserve ") == ["dgx-a:", "gpu-01:", "gpu-02:"]
    assert complete(setup, "gputop reserve gpu-0") == ["gpu-01:", "gpu-02:"]


def test_release_offers_your_reservations_on_configured_hosts(setup: dict[str, str]) -> None:
    # bash splits at ':'; the words offered are what follows it.
    assert complete(setup, "gputop release gpu-02:") == ["3"]
    assert complete(setup, "gputop reserve gpu-01:") == []  # not a blank entry
    offered = complete(setup, "gputop release ")
    assert "gpu-02:3" in offered and not any(o.startswith("gone-host") for o in offered)


def test_a_broken_config_offers_nothing_quietly(setup: dict[str, str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("hosts = [\n")
    assert complete({**setup, "GPUTOP_CONFIG": str(bad)}, "gputop reserve ") == []


def test_config_on_the_line_is_used(setup: dict[str, str], tmp_path: Path) -> None:
    other = tmp_path / "other.toml"
    other.write_text('hosts = ["only-here"]\n')
    assert complete(setup, f"gputop --config {other} reserve ") == ["only-here:"]


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_other_shells_scripts_parse(setup: dict[str, str], shell: str) -> None:
    r = subprocess.run(["gputop", "completion", shell], env=setup, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0 and "gputop completion --candidates" in r.stdout
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed: script generated, not parsed")
    r = subprocess.run([shell, "-n", "-c", r.stdout], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
