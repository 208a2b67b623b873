"""What an install costs: the core (``pip install .``) against everything
(``pip install '.[all]'``), each into a fresh virtual environment, side by side in one run.

Measures wall time of the install, packages installed and the size of the environment's
site-packages. pip's cache is used as it is (run twice for a warm cache; the first run of
a new machine also pays the downloads). Writes ``bench/results/install.md``.

    python -m bench.install_size [--runs 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def site_bytes(venv: Path) -> int:
    (site,) = venv.glob("lib/python*/site-packages")
    return sum(f.stat().st_size for f in site.rglob("*") if f.is_file())


def install(what: str, wheel: Path, tmp: Path) -> tuple[float, int, int]:
    venv = tmp / what
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
           "--disable-pip-version-check"]
    spec = str(wheel) if what == "core" else f"gputop[all] @ {wheel.as_uri()}"
    start = time.monotonic()
    subprocess.run([*pip, spec], check=True)
    took = time.monotonic() - start
    listed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list",
                             "--format=freeze", "--disable-pip-version-check"],
                            check=True, capture_output=True, text=True).stdout.split()
    return took, len(listed), site_bytes(venv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    rows: list[str] = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                        str(tmp / "w"), str(ROOT)], check=True)
        (wheel,) = (tmp / "w").glob("gputop-*.whl")
        for run in range(args.runs):
            for what in ("core", "all"):
                took, n, size = install(what, wheel, tmp / f"r{run}")
                rows.append(f"| {run + 1} | {what} | {took:.1f} | {n} | {size / 2**20:.0f} |")
                print(rows[-1], flush=True)
    out = ROOT / "bench" / "results" / "install.md"
    out.write_text(
        "# Installing gputop: the core against everything\n\n"
        "`python -m bench.install_size`: each a fresh venv, `pip install` of the same wheel, "
        "pip's cache as it was (run 1 may download, run 2 is warm).\n\n"
        "| run | install | seconds | packages | site-packages MiB |\n|---|---|---|---|---|\n"
        + "\n".join(rows) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
