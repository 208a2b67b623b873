"""Each subcommand's ``--help`` says what it does (a description, not only the usage line)
and lists only the options it uses: ``--theme`` is the board's alone, ``--interval`` only
where something loops. Shell completion offers the same options."""

from __future__ import annotations

import argparse

import pytest

from gputop.cli import bootstrap, main
from gputop.cli.main import _parser

#: The global options each subcommand takes (written out here, not read from the code).
GLOBALS = {
    "reserve": {"--config", "--timeout"},
    "extend": {"--config", "--timeout"},
    "release": {"--config", "--timeout"},
    "reservations": {"--config", "--timeout"},
    "free": {"--config", "--interval", "--timeout"},
    "run": {"--config", "--interval", "--timeout"},
    "record": {"--config", "--interval", "--timeout"},
    "report": {"--config"},
    "notify": {"--config", "--interval", "--timeout"},
    "mcp": {"--config", "--interval", "--timeout"},
    "serve": {"--config", "--interval", "--timeout"},
    "init-config": {"--config"},
    "completion": {"--config"},
}


def subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def shown_options(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions if a.help != argparse.SUPPRESS for s in a.option_strings
            if s.startswith("--") and s != "--help"}


def help_text(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_every_subcommand_is_covered() -> None:
    assert set(subparsers()) == set(GLOBALS), "a new subcommand: say which globals it takes"


@pytest.mark.parametrize("name", sorted(GLOBALS))
def test_help_has_a_description_and_only_its_own_options(
        name: str, capsys: pytest.CaptureFixture[str]) -> None:
    p = subparsers()[name]
    assert p.description and len(p.description) > 60, name
    text = help_text(capsys, name)
    assert p.description.split()[0] in text.split("\n\n")[1]  # after the usage, first
    assert "--theme" not in text
    options = shown_options(p)
    assert options & {"--config", "--interval", "--timeout", "--theme"} == GLOBALS[name]
    for opt in options:
        assert opt in text


def test_the_board_keeps_theme_and_a_subcommand_refuses_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert "--theme" in help_text(capsys)
    with pytest.raises(SystemExit) as done:
        main(["report", "--theme", "gputop-light"])
    assert done.value.code == 2
    assert "unrecognized arguments: --theme" in capsys.readouterr().err


def test_global_options_still_work_after_a_subcommand(capsys: pytest.CaptureFixture[str],
                                                      tmp_path: object) -> None:
    args = _parser().parse_args(["--config", "a.toml", "free", "--interval", "0.5",
                                 "--timeout", "3"])
    assert (args.config, args.interval, args.timeout, args.theme) == ("a.toml", 0.5, 3.0, None)
    args = _parser().parse_args(["--config", "a.toml", "reserve", "x:0"])
    assert args.config == "a.toml"  # the subcommand's unset --config does not undo it


def test_completion_offers_each_subcommands_own_options() -> None:
    parsers, offered = subparsers(), bootstrap.options()
    assert set(offered) == set(parsers)
    for name, p in parsers.items():
        assert set(offered[name]) == shown_options(p), name
    script = bootstrap.script("bash")
    assert "record) opts=\"--config --interval --timeout --db --print-unit\"" in script
    assert "report) opts=\"--config --db --since" in script and "reserve|extend|release|" in script


#: Each subcommand with one word too many (what a newcomer types).
EXTRA_WORD = {
    "reserve": ["gpu-01:0", "--for", "2", "hours"],
    "extend": ["gpu-01:0", "--for", "2", "hours"],
    "release": ["gpu-01:0", "--mine", "please"],
    "reservations": ["all"],
    "free": ["--count", "2", "gpus"],
    "run": ["--count", "1", "--bogus", "--", "true"],
    "record": ["now"],
    "report": ["--since", "1", "h"],
    "notify": ["--bogus", "status"],
    "mcp": ["stdio"],
    "serve": ["0.0.0.0:9847"],
    "init-config": ["hosts.toml"],
    "completion": ["bash", "zsh"],
}


def test_every_subcommand_has_an_extra_word_case() -> None:
    assert set(EXTRA_WORD) == set(GLOBALS)


@pytest.mark.parametrize("name", sorted(EXTRA_WORD))
def test_a_word_too_many_gets_the_subcommands_own_usage(
        name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`gputop reserve gpu-01:0 --for 2 hours` printed gputop's top-level usage, which
    says nothing of reserve's options: the subcommand's own usage and error now."""
    with pytest.raises(SystemExit) as done:
        main([name, *EXTRA_WORD[name]])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: gputop {name} ") and "COMMAND ..." not in err, err
    assert f"gputop {name}: error: unrecognized arguments: " in err, err


def test_a_unit_after_for_says_for_takes_one_word(capsys: pytest.CaptureFixture[str]) -> None:
    """`--for 2` alone is two minutes: the word `hours` after it gets a hint, not only
    "unrecognized"."""
    for argv in (["reserve", "gpu-01:0", "--for", "2", "hours"],
                 ["free", "--reserve", "--for", "3", "h"],
                 # (run's command is all that follows: `hours` would have been run)
                 ["run", "--for", "2", "hours", "--", "python", "train.py"]):
        with pytest.raises(SystemExit):
            main(argv)
        err = capsys.readouterr().err
        assert err.startswith(f"usage: gputop {argv[0]} "), err
        assert "--for takes one word, e.g. --for 2h" in err, err
        assert "a bare number is minutes" in err
    # A `--` and a unit-like word inside run's command are the command's own.
    args = _parser().parse_args(["run", "--for", "2h", "--", "sh", "-c", "x", "--", "h"])
    assert args.cmd == ["--", "sh", "-c", "x", "--", "h"]
