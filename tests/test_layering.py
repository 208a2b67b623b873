"""The data layer and the headless mode never load Textual."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DATA_LAYER = [
    "gputop.model", "gputop.config", "gputop.text", "gputop.output", "gputop.poller",
    "gputop.sources", "gputop.sources.nvidia_smi", "gputop.sources.ssh", "gputop.sources.nvml",
    "gputop.sources.transport", "gputop.sources.query", "gputop.sources.streaming",
    "gputop.reservations", "gputop.reservations.state", "gputop.reservations.records",
    "gputop.cli", "gputop.cli.table", "gputop.cli.bootstrap", "gputop.sources.demo",
    "gputop.history", "gputop.history.db", "gputop.history.recorder", "gputop.history.report",
    "gputop.history.render", "gputop.history.live", "gputop.history.cli", "gputop.cli.main",
    "gputop.cli.subcommands", "gputop.cli.headless", "gputop.cli.reserve", "gputop.cli.free",
    "gputop.cli.run", "gputop.cli.waiting", "gputop.cli.targets", "gputop.cli.lifecycle",
    "gputop.cli.options", "gputop.cli.free_table", "gputop.history.unit", "gputop.sources.hub",
    "gputop.hub.server", "gputop.cli.serve", "gputop.reservations.remote",
    "gputop.reservations.remote_scripts", "gputop.sources.shared_file", "gputop.sources.stream",
    "gputop.sources.stream_samples", "gputop.ui.board_rows", "gputop.ui.board_model",
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
            "assert rc == 3, rc  # its one host is down: exit code 3\n"
            "assert '\"hosts\"' in out.getvalue()\n"
            "print('textual' in sys.modules)\n")
    r = _fresh(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_the_ui_does_load_textual() -> None:
    """The check above can fail: importing the board really pulls Textual in."""
    r = _fresh("import sys, gputop.ui.app; print('textual' in sys.modules)")
    assert r.stdout.strip() == "True", r.stderr


# --- arrows only downward, no circles ------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
#: Each package's floor: a module may import only from its own floor or below. ``sources``
#: sits above ``reservations`` because the demo seeds the demo's reservations file.
FLOORS = {
    "gputop": 0, "model": 0, "text": 0, "config": 0, "pacing": 0, "output": 0, "extras": 0,
    "errors": 0, "notify_config": 0,
    "reservations": 1, "sources": 2, "poller": 3, "jobs": 4, "history": 4,
    "hub": 5, "agents": 5, "notify": 4, "ui": 6, "cli": 7, "__main__": 8,
}
#: Rooms on one floor that must still not see each other.
FORBIDDEN = {("ui", "hub"), ("ui", "agents"), ("jobs", "history"), ("history", "jobs"),
             ("hub", "agents"), ("agents", "hub")}


def _modules() -> dict[str, Path]:
    out = {}
    for p in (ROOT / "gputop").rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _imports() -> dict[str, set[str]]:
    """Every gputop module each module imports, at the top or inside a function."""
    import ast

    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] == "gputop":
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    edges[m].add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                edges[m].update(a.name for a in node.names if a.name.split(".")[0] == "gputop")
    return edges


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_imports_only_point_down() -> None:
    bad = []
    for a, targets in _imports().items():
        for b in targets:
            ra, rb = _room(a), _room(b)
            if ra == rb:
                continue
            assert ra in FLOORS and rb in FLOORS, f"{a} or {b}: give its room a floor"
            if FLOORS[rb] > FLOORS[ra] or (ra, rb) in FORBIDDEN:
                bad.append(f"{a} -> {b}")
    assert not bad, "imports that point up or sideways: " + ", ".join(sorted(bad))


def test_no_import_circles() -> None:
    """No module reaches itself through imports, even ones made inside functions (the old
    ``cli`` <-> ``commands`` circle went through ``run_until_signal``)."""
    edges = _imports()
    # A package's __init__ importing its own submodules is how a package exports: not a
    # circle through the package's users.
    graph = {a: {b for b in bs if not a.startswith(b + ".") and b != a} for a, bs in edges.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                circles.append(" -> ".join([*stack[stack.index(n):], n]))
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not circles, "import circles: " + "; ".join(circles)


def test_the_layering_check_can_fail(monkeypatch: object) -> None:
    """A planted upward import is caught (the rule is not vacuous)."""
    edges = _imports()
    assert any(b.startswith("gputop.reservations") for b in edges["gputop.cli.reserve"])
    assert FLOORS[_room("gputop.cli.reserve")] > FLOORS[_room("gputop.reservations.store")]
