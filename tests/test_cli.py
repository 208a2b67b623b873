"""The command line as people type it: global options anywhere, --demo --json, never a
board into a pipe, the one-shot table, init-config, and a demo that leaves nothing behind."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

ROOT = Path(__file__).resolve().parents[1]
SGR = re.compile(r"\x1b\[[0-9;]*m")


def gputop(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
           timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gputop", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=cwd, stdin=subprocess.DEVNULL)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A clean user: own config and data dirs, own TMPDIR (to see what is left there)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("GPUTOP_")}
    for k in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "TMPDIR"):
        (tmp_path / k).mkdir()
        e[k] = str(tmp_path / k)
    e.pop("COLUMNS", None)
    e.pop("NO_COLOR", None)
    return e


def read_lines(proc: subprocess.Popen[str], n: int, seconds: float) -> list[str]:
    """``n`` lines of stdout, or fail after ``seconds`` (never hang the suite)."""
    import selectors
    import time

    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline, lines = time.monotonic() + seconds, []
    while len(lines) < n:
        left = deadline - time.monotonic()
        if left <= 0 or not sel.select(left):
            proc.kill()
            pytest.fail(f"no line in {seconds}s; got {lines!r}")
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"stdout closed after {lines!r}")
        lines.append(line)
    return lines


def unreachable_config(tmp_path: Path) -> Path:
    """A host that never answers; ``gpus = 2`` lets its GPUs 0 and 1 be reserved."""
    cfg = tmp_path / "hosts.toml"
    cfg.write_text(f'[reservations]\npath = "{tmp_path / "res.json"}"\n'
                   '[[hosts]]\nname = "gpu-01"\naddress = "127.0.0.1"\nport = 1\ngpus = 2\n')
    return cfg


@pytest.mark.parametrize("where", ["before", "after", "between"])
def test_global_options_before_or_after_the_subcommand(tmp_path: Path, env: dict[str, str],
                                                       where: str) -> None:
    cfg = str(unreachable_config(tmp_path))
    opts = ["--config", cfg, "--timeout", "1"]
    args = {"before": [*opts, "reserve", "gpu-01:0", "--for", "1h"],
            "after": ["reserve", "gpu-01:0", "--for", "1h", *opts],
            "between": ["--timeout", "1", "reserve", "--config", cfg, "gpu-01:0"]}[where]
    r = gputop(*args, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("reserved gpu-01:0 until ")
    r = gputop("reservations", "--json", "--config", cfg, env=env)
    assert r.returncode == 0, r.stderr
    assert [(x["host"], x["gpu"]) for x in json.loads(r.stdout)["reservations"]] == \
        [("gpu-01", 0)]


def test_an_option_after_the_subcommand_overrides_the_one_before(
        tmp_path: Path, env: dict[str, str]) -> None:
    good = str(unreachable_config(tmp_path))
    r = gputop("--config", str(tmp_path / "missing.toml"), "reservations", "--config", good,
               env=env)
    assert r.returncode == 0, r.stderr
    r = gputop("--config", good, "reservations", "--config", str(tmp_path / "missing.toml"),
               env=env)
    assert r.returncode == 2 and "missing.toml: file not found" in r.stderr


def test_demo_json_is_a_demo_document(env: dict[str, str], schema: dict[str, object]) -> None:
    r = gputop("--demo", "--json", env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, schema)
    names = [h["name"] for h in doc["hosts"]]
    assert names[0] == "atlas" and names[-1] == "fornax"
    assert {h["source"] for h in doc["hosts"]} == {"demo"}
    assert any(g["reservation"] for h in doc["hosts"] for g in h["gpus"])
    assert os.listdir(env["TMPDIR"]) == []  # the demo's reservations folder is gone


def test_demo_json_watch_is_one_document_per_interval(env: dict[str, str]) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "gputop", "--demo", "--json", "--watch",
                             "--interval", "0.2"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines = read_lines(proc, 3, seconds=20)
    proc.terminate()
    assert proc.wait(20) == 143
    assert all(json.loads(x)["hosts"][0]["name"] == "atlas" for x in lines)
    assert os.listdir(env["TMPDIR"]) == []


def test_no_board_into_a_pipe_but_the_table(env: dict[str, str]) -> None:
    r = gputop("--demo", env=env, timeout=20)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["HOST", "GPU", "MODEL"]
    assert sum(1 for ln in lines if ln.startswith("atlas ")) == 8  # one line per GPU
    assert lines[-2].startswith("fornax") and "unreachable" in lines[-2]
    assert lines[-1] == "5 up · 1 down | 10 free · 10 busy · 2 reserved of 22 GPUs"
    assert "\x1b" not in r.stdout  # no colour, no screen switching into a pipe
    assert os.listdir(env["TMPDIR"]) == []


def test_once_colours_only_a_terminal_and_fits_its_width(env: dict[str, str]) -> None:
    master, slave = pty.openpty()
    import fcntl
    import struct
    import termios

    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 60, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "gputop", "--demo", "--once"], env=env,
                            stdout=slave, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(20) == 0
    text = out.decode()
    assert "\x1b[" in text  # coloured on a terminal
    plain = SGR.sub("", text)
    assert "\x1b" not in plain  # and nothing but colour
    lines = [ln for ln in plain.replace("\r\n", "\n").splitlines() if ln]
    assert len(lines) == 25 and max(len(ln) for ln in lines) <= 60, lines


@pytest.mark.parametrize("args", [["--demo", "--record"],
                                  ["--demo", "--json", "--watch", "--record"]])
def test_record_with_the_demo_says_the_demo_is_the_problem(env: dict[str, str],
                                                           args: list[str]) -> None:
    """Not "--record goes with the board or --json --watch" to someone who gave both."""
    r = gputop(*args, env=env)
    assert r.returncode == 2 and r.stderr == (
        "gputop: --record records your hosts, not the demo's simulated fleet (gputop "
        "--record, or gputop record)\n"), r.stderr
    r = gputop("--once", "--record", env=env)
    assert r.returncode == 2 and "--record goes with the board or --json --watch" in r.stderr


def test_once_flags_what_json_flags(env: dict[str, str]) -> None:
    """The flags that follow from time (an idle reservation) were never in the table:
    it was drawn without the idle tracker that --json's document uses."""
    doc = json.loads(gputop("--demo", "--json", env=env).stdout)
    flagged = {f"{h['name']} {g['index']}": g["flags"] for h in doc["hosts"]
               for g in h.get("gpus", []) if g["flags"]}
    assert any("idle-reservation" in f for f in flagged.values()), flagged
    table = gputop("--demo", "--once", env=env | {"COLUMNS": "200"}).stdout.splitlines()
    assert table[0].split()[-1] == "FLAGS", table[0]
    for label, flags in flagged.items():
        host, index = label.split()
        (line,) = [ln for ln in table if ln.split()[:2] == [host, index]]
        assert line.split()[-1] == ",".join(flags), (line, flags)


def test_once_and_json_are_one_or_the_other(env: dict[str, str]) -> None:
    r = gputop("--demo", "--once", "--json", env=env)
    assert r.returncode == 2 and "--once" in r.stderr


def test_demo_with_a_subcommand_says_what_the_demo_does(env: dict[str, str]) -> None:
    """A newcomer tries the tour's commands on the demo: the refusal says where the demo's
    reserve and queue are (the board) and what the subcommands need instead."""
    for args in (("--demo", "free"), ("free", "--demo"), ("reserve", "--demo", "h:0"),
                 # (a target missing too: the demo's refusal, not argparse's complaint)
                 ("reserve", "--demo"), ("--demo", "reserve"), ("--demo", "release")):
        r = gputop(*args, env=env)
        assert r.returncode == 2 and r.stdout == "", args
        command = args[0] if args[0] != "--demo" else args[1]
        assert (f"--demo cannot be used with {command}: the simulated fleet is the board"
                in r.stderr), args
        assert "gputop --demo; r reserves, Q queues there" in r.stderr
        assert "gputop init-config" in r.stderr
    assert "--demo" not in gputop("free", "--help", env=env).stdout  # (hidden there)
    # ... and it makes no abbreviation ambiguous: report --d is still --db.
    r = gputop("report", "--d", "nowhere.db", env=env)
    assert "ambiguous" not in r.stderr and "nowhere.db" in r.stderr, r.stderr


def test_abbreviations_are_a_subcommands_own(env: dict[str, str]) -> None:
    """argparse looked for the board's options in a subcommand's arguments too: `report
    --t` (only --to there) was refused as --timeout or --theme, and run's command's own
    `--h` as gputop's; `--js` before a subcommand was taken as --json and then ignored."""
    r = gputop("report", "--t", "2026-01-01", "--db", "nowhere.db", env=env)
    assert "ambiguous" not in r.stderr and "nowhere.db" in r.stderr, r.stderr
    r = gputop("run", "echo", "--h", env=env)  # (no config: this machine)
    assert "ambiguous" not in r.stderr and "usage" not in r.stderr, r.stderr
    for args, bad in ((("--js", "reservations"), "--js"), (("--onc", "reservations"), "--onc"),
                      (("run", "--cou", "1", "--", "true"), "--cou")):
        r = gputop(*args, env=env)
        assert r.returncode == 2 and f"unrecognized arguments: {bad}" in r.stderr, (args,
                                                                                  r.stderr)
    # After run's command, --demo is the command's own argument: run never refuses it.
    r = gputop("run", "echo", "--demo", env=env)  # (no config: this machine)
    assert r.returncode != 2 and "--demo cannot be used" not in r.stderr, r.stderr


def test_report_help_says_the_default_shows_users_then_hosts(env: dict[str, str]) -> None:
    """`gputop report` prints the user table and then the host table (docs/history.md);
    its --help said "default: user" alone, and a newcomer looked for the second table."""
    r = gputop("report", "--help", env=env | {"COLUMNS": "200"})
    assert r.returncode == 0
    assert "the table to show (default: user, then the host table)" in r.stdout


def test_init_config_help_names_the_path_it_writes_to(env: dict[str, str]) -> None:
    """Where it writes, as this machine resolves it ($XDG_CONFIG_HOME moves it), not
    a fixed ~/.config that a newcomer with XDG_CONFIG_HOME set would look in for nothing."""
    r = gputop("init-config", "--help", env=env | {"COLUMNS": "400"})
    assert r.returncode == 0
    assert f"else {Path(env['XDG_CONFIG_HOME']) / 'gputop' / 'hosts.toml'} (your user" in r.stdout


def test_init_config_writes_the_example_and_never_overwrites(env: dict[str, str]) -> None:
    target = Path(env["XDG_CONFIG_HOME"]) / "gputop" / "hosts.toml"
    r = gputop("init-config", env=env)
    assert r.returncode == 0, r.stderr
    assert target.read_text() == (ROOT / "hosts.example.toml").read_text()
    assert str(target) in r.stdout
    # The written file is what gputop then reads.
    r = gputop("reservations", env=env)
    assert r.returncode == 0, r.stderr
    target.write_text("# mine\n")
    r = gputop("init-config", env=env)
    assert r.returncode == 1 and "already exists" in r.stderr
    assert target.read_text() == "# mine\n"


def test_init_config_follows_no_link_and_honours_config(tmp_path: Path,
                                                        env: dict[str, str]) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    link = tmp_path / "link.toml"
    link.symlink_to(victim)
    r = gputop("init-config", "--config", str(link), env=env)
    assert r.returncode == 1 and victim.read_text() == "keep"
    r = gputop("init-config", "--config", str(tmp_path / "new" / "h.toml"), env=env)
    assert r.returncode == 0 and (tmp_path / "new" / "h.toml").exists()
    r = gputop("init-config", "--stdout", env=env)
    assert r.stdout == (ROOT / "hosts.example.toml").read_text()


def test_no_config_hint_names_the_command(env: dict[str, str]) -> None:
    r = gputop("--json", "--timeout", "1", env=env)
    answered = any(h["status"] == "ok" for h in json.loads(r.stdout)["hosts"])
    assert r.returncode == (0 if answered else 3)  # (this machine may have no GPU)
    assert "gputop init-config" in r.stderr


@pytest.mark.parametrize("output", ["--json", "--once"])
def test_no_host_answering_has_its_own_exit_code(tmp_path: Path, env: dict[str, str],
                                                 output: str) -> None:
    """Every host failed: the output is still written, each host with its reason, and
    the exit code (3) tells a script so; one host answering is enough for 0 (the fleet
    tests run ``--json`` on fleets with some hosts down and expect 0)."""
    r = gputop("--config", str(unreachable_config(tmp_path)), output, "--timeout", "1",
               env=env)
    assert r.returncode == 3, (r.returncode, r.stderr)
    if output == "--json":
        (host,) = json.loads(r.stdout)["hosts"]
        assert host["status"] == "error" and host["error"]["kind"] == "unreachable"
    else:
        assert "gpu-01" in r.stdout and "unreachable" in r.stdout
    help_text = gputop("--help", env=env).stdout
    assert "3 --json/--once/free: no host answered" in " ".join(help_text.split())
    docs = " ".join(p.read_text() for p in [ROOT / "README.md", *ROOT.glob("docs/*.md")])
    assert "`3`" in docs and "where no host answered" in docs  # with the other exit codes


@pytest.mark.parametrize(("args", "said"), [
    (["--hub", "http://127.0.0.1:1/", "reservations"], "--hub does nothing for reservations"),
    (["--interval=1", "reserve", "a:0"], "--interval does nothing for reserve"),
    (["--theme", "gputop-light", "free"], "--theme does nothing for free"),
    # (a value that is the subcommand's name is a value: the subcommand comes after it)
    (["--config", "reservations", "--hub", "http://127.0.0.1:1/", "reservations"],
     "--hub does nothing for reservations"),
])
def test_a_global_option_a_subcommand_does_not_take_is_refused_before_it_too(
        env: dict[str, str], args: list[str], said: str) -> None:
    """Before the subcommand it was taken and ignored; after it, refused: refused both."""
    r = gputop(*args, env=env)
    assert r.returncode == 2 and said in r.stderr and "which takes --config" in r.stderr, \
        r.stderr


@pytest.mark.parametrize("args", [["--json", "reservations"], ["--once", "free"],
                                  ["--json", "--watch", "release", "--mine"]])
def test_an_output_option_before_a_subcommand_is_an_error_not_ignored(
        tmp_path: Path, env: dict[str, str], args: list[str]) -> None:
    r = gputop("--config", str(unreachable_config(tmp_path)), *args, env=env)
    assert r.returncode == 2 and "does nothing" in r.stderr, (r.returncode, r.stderr)
    assert r.stdout == ""


def test_a_memory_size_without_a_unit_is_refused(tmp_path: Path, env: dict[str, str]) -> None:
    r = gputop("free", "--min-free-memory", "20", "--config",
               str(unreachable_config(tmp_path)), env=env)
    assert r.returncode == 2 and "needs a unit" in r.stderr and "20G" in r.stderr, r.stderr


def test_several_hosts_in_one_argument_says_how_to_write_them(
        tmp_path: Path, env: dict[str, str]) -> None:
    r = gputop("reserve", "a:1,b:2", "--config", str(unreachable_config(tmp_path)), env=env)
    assert r.returncode == 2 and "one argument each" in r.stderr, r.stderr


def test_a_fresh_reservation_reads_its_full_length(tmp_path: Path,
                                                   env: dict[str, str]) -> None:
    r = gputop("reserve", "gpu-01:0", "--for", "2h", "--config",
               str(unreachable_config(tmp_path)), "--timeout", "1", env=env)
    assert r.returncode == 0 and "(2h00m left)" in r.stdout, r.stdout + r.stderr
