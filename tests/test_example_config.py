"""The example hosts file (``hosts.example.toml``, what ``gputop init-config`` writes) still
loads when a newcomer uncomments every commented setting in it, and shows every key the
loader knows, section by section."""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

import pytest

from gputop.cli import main
from gputop.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
#: A commented-out setting: ``# key = value`` or ``# [table]`` (prose never starts so).
SETTING = re.compile(r"^(\s*)#\s?(?=[A-Za-z_][A-Za-z0-9_-]*\s*=|\[)")


def uncomment(text: str) -> tuple[str, int]:
    """``text`` with every commented-out setting made live; how many there were."""
    lines, n = [], 0
    for line in text.splitlines():
        live, k = SETTING.subn(r"\1", line)
        lines.append(live)
        n += k
    return "\n".join(lines) + "\n", n


def init_config_output() -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["init-config", "--stdout"]) == 0
    return out.getvalue()


def known_keys(tmp_path: Path, section: str) -> set[str]:
    """The keys the loader accepts in ``section`` ("" for the top level, "hosts" for a
    [[hosts]] table), read from its own unknown-key message."""
    body = {"": 'zz_unknown = 1\nhosts = ["a"]\n',
            "hosts": '[[hosts]]\nname = "a"\nzz_unknown = 1\n'}.get(
        section, f'hosts = ["a"]\n[{section}]\nzz_unknown = 1\n')
    p = tmp_path / f"probe-{section or 'top'}.toml"
    p.write_text(body)
    with pytest.raises(ConfigError) as err:
        load_config(str(p))
    m = re.search(r"known keys here: (.*)\)$", str(err.value))
    assert m, str(err.value)
    return set(m.group(1).split(", "))


@pytest.mark.parametrize("source", ["hosts.example.toml", "init-config"])
def test_every_commented_setting_uncommented_still_loads(tmp_path: Path, source: str) -> None:
    text = ((ROOT / source).read_text(encoding="utf-8") if source.endswith(".toml")
            else init_config_output())
    live, n = uncomment(text)
    assert n >= 10, "the example's optional keys are shown commented out"
    p = tmp_path / "hosts.toml"
    p.write_text(live)
    cfg = load_config(str(p))  # a ConfigError here names the key a newcomer would trip on
    assert [h.name for h in cfg.hosts] == ["gpu-01", "gpu-02", "workstation"]
    gpu02 = cfg.host("gpu-02")
    assert gpu02 is not None and (gpu02.address, gpu02.port, gpu02.user) == (
        "10.0.0.12", 22, "alice")
    assert str(cfg.reservations_path) == "/shared/team/gputop/reservations.json"


def test_init_config_writes_the_example() -> None:
    assert init_config_output() == (ROOT / "hosts.example.toml").read_text(encoding="utf-8")


def test_the_example_shows_every_key_the_loader_knows(tmp_path: Path) -> None:
    live, _ = uncomment((ROOT / "hosts.example.toml").read_text(encoding="utf-8"))
    doc = tomllib.loads(live)
    assert set(doc) == known_keys(tmp_path, ""), "a top-level table missing from the example"
    for section, table in doc.items():
        # [[hosts]]: the keys of all the example's host tables together
        shown = set().union(*map(set, table)) if section == "hosts" else set(table)
        assert shown == known_keys(tmp_path, section), section


def test_uncomment_leaves_prose_alone() -> None:
    assert uncomment("# Each host is an SSH destination\n#   (see: x = y)\n")[1] == 0
    assert uncomment("  # port = 22   # a note\n# [history]\n") == (
        "  port = 22   # a note\n[history]\n", 2)
