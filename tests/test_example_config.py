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
from gputop.config.load import Config, load_config
from gputop.config.tables import Defaults, History, HostConfig, Hub, Reservations
from gputop.config.values import ConfigError

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
    assert str(cfg.reservations.path) == "/shared/team/gputop/reservations.json"


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


#: Commented keys whose value in the example is an illustration, not the default.
ILLUSTRATIONS = {"path", "ssh_config", "theme", "listen", "token_file", "url"}
_COMMENTED_KEY = re.compile(r"^\s*#\s?([A-Za-z_][A-Za-z0-9_-]*)\s*=")


def test_a_file_that_sets_nothing_gives_the_dataclasses_defaults(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each default is the table dataclass's: the parser restates none of them."""
    monkeypatch.delenv("GPUTOP_RESERVATIONS", raising=False)
    p = tmp_path / "hosts.toml"
    p.write_text('hosts = ["a"]\n[defaults]\n[reservations]\n[history]\n[hub]\n')
    assert load_config(str(p)) == Config(path=p, hosts=(HostConfig("a"),))
    monkeypatch.delenv("GPUTOP_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "nothing-here"))
    assert load_config() == Config(path=None, hosts=(HostConfig("localhost", local=True),),
                                   implicit=True)


def test_the_examples_values_are_the_defaults(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """What the example shows, live or commented out (but for illustrations such as a
    path), is what leaving the key out gives."""
    monkeypatch.delenv("GPUTOP_RESERVATIONS", raising=False)
    lines, table, shown = [], "", 0
    for line in (ROOT / "hosts.example.toml").read_text(encoding="utf-8").splitlines():
        if line.startswith("[") or line.startswith("# ["):
            table = line.removeprefix("# ").strip("[]")
        m = _COMMENTED_KEY.match(line)
        if m and table in ("defaults", "reservations", "history", "hub") \
                and m.group(1) not in ILLUSTRATIONS:
            line, shown = SETTING.sub(r"\1", line), shown + 1
        lines.append(line)
    assert shown >= 10
    p = tmp_path / "hosts.toml"
    p.write_text("\n".join(lines) + "\n")
    cfg = load_config(str(p))
    assert (cfg.defaults, cfg.reservations, cfg.history, cfg.hub) == (
        Defaults(), Reservations(), History(), Hub())
