"""Installed, not just checked out: the wheel (built directly, and from the sdist as pipx
and uv do) ships the built-in themes and the example config, and an install run from
another directory finds them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = {".venv", ".git", "build", "dist", ".pytest_cache", ".mypy_cache", ".ruff_cache",
        "__pycache__", "tests", "bench"}


def build(kind: str, src: Path, out: Path) -> Path:
    """The PEP 517 backend, as pip, pipx and uv call it (no network: this venv's setuptools)."""
    out.mkdir(parents=True, exist_ok=True)
    code = (f"from setuptools import build_meta as b; print(b.build_{kind}({str(out)!r}))")
    r = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return out / r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=lambda d, names: [
        n for n in names if n in SKIP or n.endswith(".egg-info")])
    sdist = build("sdist", src, tmp / "sdist")
    with tarfile.open(sdist) as t:
        t.extractall(tmp / "unpacked", filter="data")
    (unpacked,) = (tmp / "unpacked").iterdir()
    return {"direct": build("wheel", src, tmp / "wheel"),
            "from-sdist": build("wheel", unpacked, tmp / "wheel-from-sdist")}


@pytest.mark.parametrize("how", ["direct", "from-sdist"])
def test_wheel_ships_themes_and_example_config(wheels: dict[str, Path], how: str) -> None:
    names = set(zipfile.ZipFile(wheels[how]).namelist())
    for theme in sorted((ROOT / "themes").glob("*.toml")):
        assert f"gputop/data/themes/{theme.name}" in names
    assert "gputop/data/hosts.example.toml" in names
    assert "gputop/schema/snapshot.schema.json" in names and "gputop/ui/gputop.tcss" in names
    assert "gputop/history/gputop-record.service" in names  # gputop record --print-unit
    # The hub's web page and what runs it for a team (unit, scrape job, dashboard).
    for f in sorted((ROOT / "gputop" / "hub" / "web").iterdir()):
        assert f"gputop/hub/web/{f.name}" in names
    for f in ("gputop-hub.service", "prometheus-scrape.yml", "grafana-dashboard.json"):
        assert f"gputop/hub/deploy/{f}" in names
    data = zipfile.ZipFile(wheels[how]).read("gputop/data/hosts.example.toml")
    assert data == (ROOT / "hosts.example.toml").read_bytes()


def test_installed_copy_finds_them_from_elsewhere(wheels: dict[str, Path],
                                                  tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheels["from-sdist"]).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    env.pop("GPUTOP_CONFIG", None)
    code = ("import gputop, gputop.ui.themes as t\n"
            f"assert gputop.__file__.startswith({str(site)!r}), gputop.__file__\n"
            "print(sorted(t.load_themes().themes))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert {"gputop-light", "gputop-contrast", "gputop-dark"} <= set(eval(r.stdout))
    r = subprocess.run([sys.executable, "-m", "gputop", "init-config"], cwd=elsewhere,
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    written = tmp_path / "cfg" / "gputop" / "hosts.toml"
    assert written.read_bytes() == (ROOT / "hosts.example.toml").read_bytes()


@pytest.fixture(scope="module")
def core_venv(wheels: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the core alone (``pip install gputop``, no extra):
    its dependencies come from the package index as a new user's do."""
    venv = tmp_path_factory.mktemp("core") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                        "--disable-pip-version-check", str(wheels["direct"])],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return venv


def _core(venv: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GPUTOP_CONFIG", "GPUTOP_RESERVATIONS", "PYTHONPATH")}
    env.update(XDG_CONFIG_HOME=str(tmp / "cfg"), XDG_DATA_HOME=str(tmp / "data"),
               XDG_STATE_HOME=str(tmp / "state"), HOME=str(tmp))
    return subprocess.run([str(venv / "bin" / "gputop"), *args], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_core_alone_has_no_servers(core_venv: Path) -> None:
    names = subprocess.run([str(core_venv / "bin" / "python"), "-m", "pip", "list",
                            "--format=freeze", "--disable-pip-version-check"],
                           capture_output=True, text=True, check=True).stdout.lower()
    for extra in ("mcp==", "pydantic==", "uvicorn==", "starlette==", "prometheus-client=="):
        assert extra not in names, names
    assert "textual==" in names and "asyncssh==" in names


def test_the_core_alone_runs_the_board_json_and_reserve(core_venv: Path, tmp_path: Path) -> None:
    r = _core(core_venv, tmp_path, "--demo", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["hosts"]
    cfg = tmp_path / "hosts.toml"
    cfg.write_text('[defaults]\ntimeout = 1\n[reservations]\npath = "r.json"\n'
                   '[[hosts]]\nname = "box"\naddress = "127.0.0.1"\nport = 1\ngpus = 2\n')
    r = _core(core_venv, tmp_path, "reserve", "box:1", "--for", "1h", "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    assert "reserved box:1" in r.stdout
    r = _core(core_venv, tmp_path, "reservations", "--config", str(cfg))
    assert r.returncode == 0 and "box:1" in r.stdout, r.stderr
    code = "import gputop.ui.app, gputop.reservations.store; print('ok')"
    r = subprocess.run([str(core_venv / "bin" / "python"), "-c", code], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "ok", r.stderr


@pytest.mark.parametrize(("command", "extra"), [(("mcp",), "mcp"),
                                                (("serve", "--demo"), "hub")])
def test_a_command_whose_extra_is_missing_says_what_to_install(
        core_venv: Path, tmp_path: Path, command: tuple[str, ...], extra: str) -> None:
    r = _core(core_venv, tmp_path, *command)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("gputop: ") and f"pip install '.[{extra}]'" in line, line
    assert "Traceback" not in r.stderr


def test_serve_prints_the_shipped_deploy_files_from_an_install(wheels: dict[str, Path],
                                                               tmp_path: Path) -> None:
    """After pipx install the scrape job and dashboard sit deep in site-packages: `gputop
    serve --print-...` prints them, equal to the shipped files, from an installed copy run
    elsewhere (no checkout, no hosts file)."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheels["direct"]).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    env.pop("GPUTOP_CONFIG", None)
    deploy = ROOT / "gputop" / "hub" / "deploy"
    for flag, name in (("--print-scrape-config", "prometheus-scrape.yml"),
                       ("--print-grafana-dashboard", "grafana-dashboard.json")):
        r = subprocess.run([sys.executable, "-c", "import gputop, sys; "
                            f"assert gputop.__file__.startswith({str(site)!r}); "
                            "from gputop.cli import main; sys.exit(main(sys.argv[1:]))",
                            "serve", flag], cwd=elsewhere, env=env, capture_output=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout == (deploy / name).read_bytes(), flag
