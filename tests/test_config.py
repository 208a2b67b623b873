"""Config mistakes name the file and the key, exit 2, and never show a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gputop.config.load import load_config
from gputop.config.values import ConfigError, parse_duration

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "hosts.toml"
    p.write_text(text)
    return p


def test_example_config_is_valid_and_documents_every_key() -> None:
    cfg = load_config(str(ROOT / "hosts.example.toml"))
    assert [h.name for h in cfg.hosts][:2] == ["gpu-01", "gpu-02"]
    text = (ROOT / "hosts.example.toml").read_text()
    for key in ("interval", "timeout", "max_connecting", "ssh_config", "theme",
                "idle_holder_after", "address", "port", "user", "tags", "local", "gpus",
                "path", "default_duration", "max_duration", "idle_grace",
                "keep_raw", "keep_minutes", "keep_hours", "url",
                "fallback", "token_file", "listen"):
        assert f"{key} =" in text or f"# {key} =" in text, key


def test_full_shape(tmp_path: Path) -> None:
    cfg = load_config(str(write(tmp_path, """
hosts = ["a", "b"]
[defaults]
interval = 5
timeout = 4.5
[reservations]
path = "res.json"
default_duration = "2h"
max_duration = "1d"
""")))
    assert [h.name for h in cfg.hosts] == ["a", "b"]
    assert (cfg.defaults.interval, cfg.defaults.timeout) == (5.0, 4.5)
    assert cfg.reservations.path == tmp_path / "res.json"
    assert (cfg.reservations.default_s, cfg.reservations.max_s) == (7200, 86400)


def test_table_hosts(tmp_path: Path) -> None:
    cfg = load_config(str(write(tmp_path, """
[[hosts]]
name = "gpu-01"
address = "10.0.0.5"
port = 2222
user = "me"
tags = ["a100", "team-x"]
gpus = 8
[[hosts]]
name = "workstation"
local = true
""")))
    h = cfg.hosts[0]
    assert (h.address, h.port, h.user, h.tags, h.local, h.gpus) == (
        "10.0.0.5", 2222, "me", ("a100", "team-x"), False, 8)
    assert cfg.hosts[1].local and cfg.hosts[1].gpus is None


@pytest.mark.parametrize(("text", "key", "words"), [
    ('hosts = ["a"]\n[defaults]\nintervall = 2\n', "defaults.intervall", "unknown key"),
    ('hosts = ["a"]\n[defaults]\ntimeout = "soon"\n', "defaults.timeout", "must be"),
    ('hosts = ["a"]\n[defaults]\ntimeout = true\n', "defaults.timeout", "boolean"),
    ('[[hosts]]\nname = "a"\n[[hosts]]\nname = "a"\n', "hosts[1].name", "duplicate"),
    ('[[hosts]]\nname = "a"\nport = 70000\n', "hosts[0].port", "between"),
    ('[[hosts]]\nname = "a b"\n', "hosts[0].name", "not a host name"),
    ('[[hosts]]\nname = "a"\ntags = [1]\n', "hosts[0].tags", "array of strings"),
    ('[[hosts]]\nport = 22\n', "hosts[0].name", "required"),
    ('[[hosts]]\nname = "a"\ncolour = "red"\n', "hosts[0].colour", "unknown key"),
    ('hosts = ["a"]\n[reservations]\ndefault_duration = "forever"\n',
     "reservations.default_duration", "not a duration"),
    ('hosts = ["a"]\nextra = 1\n', "extra", "unknown key"),
    ('[defaults]\n', "hosts", "no hosts"),
    ('[[hosts]]\nname = "ws"\nlocal = true\naddress = "10.0.0.5"\n', "hosts[0].address",
     "cannot be used with local"),
    ('[[hosts]]\nname = "ws"\nuser = "me"\nlocal = true\n', "hosts[0].user",
     "cannot be used with local"),
    ('hosts = ["a"]\n[history]\nkeep_hours = "always"\n', "history.keep_hours",
     "not a duration"),
    ('hosts = ["a"]\n[history]\nkeep_hours = true\n', "history.keep_hours", "boolean"),
    ('[[hosts]]\nname = "a"\ngpus = 0\n', "hosts[0].gpus", "between 1 and 256"),
    ('[[hosts]]\nname = "a"\ngpus = 65536\n', "hosts[0].gpus", "between 1 and 256"),
    ('[[hosts]]\nname = "a"\ngpus = -1\n', "hosts[0].gpus", "between 1 and 256"),
    ('[[hosts]]\nname = "a"\ngpus = "8"\n', "hosts[0].gpus", "must be an integer"),
    ('[[hosts]]\nname = "a"\ngpus = 8.0\n', "hosts[0].gpus", "must be an integer"),
    ('[[hosts]]\nname = "a"\ngpus = true\n', "hosts[0].gpus", "boolean"),
    ('hosts = ["a"]\n[history]\nkeep_hours = "12h"\n', "history.keep_hours", "at least 1d"),
    ('hosts = ["a"]\n[history]\nkeep_minutes = "60d"\nkeep_hours = "30d"\n',
     "history.keep_hours", "keep_minutes"),
])
def test_mistakes_name_the_key(tmp_path: Path, text: str, key: str, words: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        load_config(str(path))
    assert exc.value.key == key
    assert str(path) in str(exc.value) and words in str(exc.value)


@pytest.mark.parametrize(("value", "seconds"), [(None, None), ('"forever"', None),
                                               ('"365d"', 365 * 86400.0), ("45000", 45000 * 60.0)])
def test_keep_hours(tmp_path: Path, value: str | None, seconds: float | None) -> None:
    body = 'hosts = ["a"]\n[history]\nkeep_raw = "6h"\n'
    cfg = load_config(str(write(tmp_path, body + (f"keep_hours = {value}\n" if value else ""))))
    assert cfg.history.keep_hours_s == seconds and cfg.history.keep_raw_s == 6 * 3600


def test_invalid_toml_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, 'hosts = ["a"]\n[defaults\n')
    with pytest.raises(ConfigError) as exc:
        load_config(str(path))
    assert "line 2" in str(exc.value) and str(path) in str(exc.value)


@pytest.mark.parametrize("content", [b'hosts = ["a"]\n[defaults]\nfoo = 1\n', b"\xff\xfe", None])
def test_cli_exits_2_with_one_line_and_no_traceback(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "hosts.toml"
    if content is not None:
        path.write_bytes(content)
    r = subprocess.run([sys.executable, "-m", "gputop", "--json", "--config", str(path)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert r.stdout == ""
    assert "Traceback" not in r.stderr and str(path) in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_unreadable_file_is_a_clear_error(tmp_path: Path) -> None:
    path = write(tmp_path, 'hosts = ["a"]\n')
    path.chmod(0)
    try:
        if path.open("rb"):  # root reads anything: nothing to test then
            pytest.skip("running as root: permissions are not enforced")
    except PermissionError:
        with pytest.raises(ConfigError, match="cannot read"):
            load_config(str(path))


def test_lookup_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_cfg = write(tmp_path, 'hosts = ["from-env"]\n')
    monkeypatch.setenv("GPUTOP_CONFIG", str(env_cfg))
    assert load_config(None).hosts[0].name == "from-env"
    cli = tmp_path / "cli.toml"
    cli.write_text('hosts = ["from-cli"]\n')
    assert load_config(str(cli)).hosts[0].name == "from-cli"
    monkeypatch.delenv("GPUTOP_CONFIG")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "nothing"))
    implicit = load_config(None)
    assert implicit.implicit and implicit.hosts[0].local


def test_durations() -> None:
    assert parse_duration("90m") == 5400 and parse_duration("2h") == 7200
    assert parse_duration("1d") == 86400 and parse_duration("30") == 1800
    for bad in ("", "0h", "-1h", "2x", "h"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_usage_errors_exit_2() -> None:
    r = subprocess.run([sys.executable, "-m", "gputop", "--watch"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and "--watch needs --json" in r.stderr
    r = subprocess.run([sys.executable, "-m", "gputop", "--bogus"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2


@pytest.mark.parametrize(("position"), [0, 1, 2])
@pytest.mark.parametrize(("key", "value"), [
    ("name", "-oProxyCommand=touch"), ("name", "-F"), ("name", "gpu..01"), ("name", "@gpu"),
    ("address", "-oProxyCommand=sh"), ("address", "-1"), ("address", "a..b"),
    ("address", "alice@10.0.0.1"), ("address", "gpu+1"),
])
def test_a_name_or_address_that_cannot_be_a_host_names_the_key(
        tmp_path: Path, position: int, key: str, value: str) -> None:
    """First, middle and last host: ssh would read a leading '-' as an option."""
    hosts = [{"name": f"ok-{i}"} for i in range(3)]
    hosts[position][key] = value
    text = "".join("[[hosts]]\n" + "".join(f'{k} = "{v}"\n' for k, v in h.items())
                   for h in hosts)
    path = write(tmp_path, text)
    r = subprocess.run([sys.executable, "-m", "gputop", "--json", "--config", str(path)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stdout
    assert r.stdout == "" and "Traceback" not in r.stderr
    assert f"{path}: hosts[{position}].{key}: " in r.stderr, r.stderr


@pytest.mark.parametrize("value", ["10.0.0.5", "gpu-01.example.com", "fe80::1%eth0", "[::1]",
                                   "gpu_01", "gpu-01.lab."])
def test_real_addresses_are_accepted(tmp_path: Path, value: str) -> None:
    cfg = load_config(str(write(tmp_path, f'[[hosts]]\nname = "a"\naddress = "{value}"\n')))
    assert cfg.hosts[0].address == value
