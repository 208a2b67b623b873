"""ruff and mypy are part of the test run, so a red lint is a red build."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("tool", [["ruff", "check", "."], ["mypy"]])
def test_clean(tool: list[str]) -> None:
    if shutil.which(tool[0]) is None and not (Path(sys.executable).parent / tool[0]).exists():
        pytest.skip(f"{tool[0]} is not installed (pip install -e '.[test]')")
    exe = str(Path(sys.executable).parent / tool[0])
    if not Path(exe).exists():
        exe = tool[0]
    r = subprocess.run([exe, *tool[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
