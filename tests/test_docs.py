"""The README stays a page a newcomer reads (at most 150 lines, the test command CI runs),
and every file the README and docs/ point to exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
#: `docs/x.md`-style mentions in running text, not only markdown links.
MENTION = re.compile(r"(?<![\w/.])((?:docs|bench/results|gputop|tests)/[\w./-]+\.(?:md|png|svg|"
                     r"py|json|service))")


def test_readme_is_short_and_runs_the_ci_test_command() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    assert "\npython -m pytest\n" in text
    assert "\npython -m pytest\n" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "docs/img/board.png" in text and (ROOT / "docs/img/board.png").stat().st_size > 10_000


def test_every_page_starts_with_what_a_user_does() -> None:
    for page in PAGES[1:]:
        lines = page.read_text(encoding="utf-8").splitlines()
        assert lines[0].startswith("# "), page.name
        assert lines[2].startswith("What you do"), page.name


def test_links_and_paths_point_at_files_that_exist() -> None:
    missing = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        text = re.sub(r"<!--.*?-->", "", text, flags=re.S)  # placeholders for pages to come
        for target in LINK.findall(text):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                missing.append(f"{page.name}: ({target})")
        for target in MENTION.findall(text):
            if not (ROOT / target).exists():
                missing.append(f"{page.name}: {target}")
    assert not missing, missing


def test_exit_codes_page_and_help_come_from_one_table() -> None:
    """docs/exit-codes.md's table and ``gputop --help``'s last line are gputop.errors's."""
    from gputop.cli.main import _parser
    from gputop.errors import EXIT_CODES, docs_table, help_epilog

    assert docs_table() in (ROOT / "docs" / "exit-codes.md").read_text()
    assert _parser().epilog == help_epilog()
    assert {e.code for e in EXIT_CODES} >= {0, 1, 2, 3, 4, 130}
