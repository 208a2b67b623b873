"""Draw docs/img/board.svg (and board.png, with headless chromium where installed): the
board on the built-in demo fleet, as README.md shows it.

    python docs/img/make_board.py            # after a change to the board's looks
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from gputop.sources.demo import demo_session
from gputop.ui.app import GputopApp

HERE = Path(__file__).resolve().parent
SIZE = (120, 34)


async def shoot() -> str:
    with demo_session() as (config, sources):
        app = GputopApp(config, sources=list(sources))
        async with app.run_test(size=SIZE) as pilot:
            for _ in range(40):  # until every demo host has answered (a few refreshes)
                await asyncio.sleep(0.25)
                await pilot.pause()
            await asyncio.sleep(2.5)
            await pilot.pause()
            return app.export_screenshot(title="gputop --demo")


def png(svg: Path, out: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("no chromium: board.png not redrawn", file=sys.stderr)
        return
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "board.html"
        page.write_text("<html><body style='margin:0;background:#fff'>"
                        f"{svg.read_text(encoding='utf-8')}</body></html>", encoding="utf-8")
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                        "--hide-scrollbars", f"--screenshot={out}", "--window-size=1500,900",
                        page.as_uri()], check=True, capture_output=True, timeout=120)


def main() -> None:
    svg = HERE / "board.svg"
    svg.write_text(asyncio.run(shoot()), encoding="utf-8")
    png(svg, HERE / "board.png")
    print(f"wrote {svg}")


if __name__ == "__main__":
    main()
