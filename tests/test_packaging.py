"""Installed, not just checked out: the wheel (built directly, and from the sdist as pipx
and uv do) ships the built-in themes and the example config, and an install run from
another directory finds them."""

from __future__ import annotations

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
