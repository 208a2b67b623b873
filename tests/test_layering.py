"""The data layer and the headless mode never load Textual."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DATA_LAYER = [
    "gputop.model", "gputop.config", "gputop.text", "gputop.output", "gputop.poller",
    "gputop.sources", "gputop.sources.nvidia_smi", "gputop.sources.ssh", "gputop.sources.nvml",
    "gputop.reservations", "gputop.cli", "gputop.table", "gputop.bootstrap", "gputop.demo",
    "gputop.history", "gputop.history.db", "gputop.history.recorder", "gputop.history.report",
    "gputop.history.render", "gputop.history.live", "gputop.history.cli", "gputop.commands",
]


def _fresh(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)


def test_data_layer_imports_without_textual() -> None:
    code = ("import importlib, sys\n"
            f"for m in {DATA_LAYER!r}: importlib.import_module(m)\n"
            "bad = sorted(m for m in sys.modules if m == 'textual' or m.startswith('textual.'))\n"
            "print(bad)\n")
    r = _fresh(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_json_mode_does_not_load_textual(tmp_path: Path) -> None:
    cfg = tmp_path / "hosts.toml"
    cfg.write_text('[defaults]\ntimeout = 1\n[[hosts]]\nname = "x"\naddress = "127.0.0.1"\n'
                   'port = 1\n')
    code = ("import sys, io, contextlib\nfrom gputop.cli import main\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            f"    rc = main(['--json', '--config', {str(cfg)!r}])\n"
            "assert rc == 0, rc\nassert '\"hosts\"' in out.getvalue()\n"
            "print('textual' in sys.modules)\n")
    r = _fresh(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_the_ui_does_load_textual() -> None:
    """The check above can fail: importing the board really pulls Textual in."""
    r = _fresh("import sys, gputop.ui.app; print('textual' in sys.modules)")
    assert r.stdout.strip() == "True", r.stderr
