"""Compare two Textual SVG screenshots cell by cell (character, text style, background).

Two renderings can split a line into different runs (one wide cell or a cell plus a blank
filler) and still look the same; this says whether they do. Used to check that the virtual
table draws the board exactly as the DataTable did:

    python -m bench.svg_cells OLD.svg NEW.svg
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path

CELL_W, LINE_H = 12.2, 24.4


def cells(svg: str) -> dict[tuple[int, int], tuple[str, str, str]]:
    styles = dict(re.findall(r"\.(terminal-r\d+) \{([^}]*)\}", svg))
    out: dict[tuple[int, int], list[str]] = {}
    for fill, x, y, w in re.findall(
            r'<rect fill="([^"]+)" x="([\d.]+)" y="([\d.]+)" width="([\d.]+)"', svg):
        row, col0 = round((float(y) - 1.5) / LINE_H), round(float(x) / CELL_W)
        for col in range(col0, col0 + round(float(w) / CELL_W)):
            out.setdefault((row, col), [" ", "", ""])[2] = fill
    for cls, x, y, text in re.findall(
            r'<text class="([^"]+)" x="([\d.]+)" y="([\d.]+)" textLength="[\d.]+"'
            r'[^>]*>([^<]*)</text>', svg):
        row, col0 = round((float(y) - 20) / LINE_H), round(float(x) / CELL_W)
        for i, ch in enumerate(html.unescape(text).replace("\xa0", " ")):
            cell = out.setdefault((row, col0 + i), [" ", "", ""])
            cell[0], cell[1] = ch, styles.get(cls, cls).strip()
    return {k: (c, s if c != " " else "", b) for k, (c, s, b) in out.items()}


def main() -> int:
    old, new = (cells(Path(p).read_text(encoding="utf-8")) for p in sys.argv[1:3])
    diff = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    for k in diff[:20]:
        print(k, old.get(k), new.get(k))
    print(f"{len(diff)} cells differ of {len(old)}")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
