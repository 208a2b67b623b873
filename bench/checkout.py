"""Time another checkout's code: import the ``gputop`` package of a given tree.

The package is loaded from ``TREE/gputop`` by its path, so every ``gputop.*`` imported
after it comes from that tree too (through the package's own ``__path__``), whatever is
installed; the benchmark's own helpers (``bench``, ``tests.support``) stay this checkout's.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_gputop(tree: str | Path) -> ModuleType:
    """``TREE``'s gputop, imported now unless a gputop is already loaded (then that one)."""
    if "gputop" in sys.modules:
        return sys.modules["gputop"]
    pkg = Path(tree).resolve() / "gputop"
    spec = importlib.util.spec_from_file_location(
        "gputop", pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    if spec is None or spec.loader is None:
        raise ImportError(f"no gputop package under {tree}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gputop"] = mod
    spec.loader.exec_module(mod)
    return mod


def unload_gputop() -> None:
    """Forget every gputop module, so the next :func:`load_gputop` reads another tree."""
    for name in [m for m in sys.modules if m == "gputop" or m.startswith("gputop.")]:
        del sys.modules[name]
