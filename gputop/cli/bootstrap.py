"""Commands that run without a hosts file: ``init-config`` and ``completion``.

``init-config`` writes the documented example (shipped in the package) to the config path,
never over an existing file. ``completion SHELL`` prints a script for bash, zsh or fish that
calls back ``gputop completion --candidates KIND`` for host names and ``HOST:GPU``
targets: from the config (and, for ``release``, your reservations), never from the network.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gputop.cli.options import ALL as ALL_GLOBAL_OPTIONS
from gputop.cli.options import for_command
from gputop.config.load import data_path, default_config_path, find_config, load_config
from gputop.config.values import ConfigError

EXIT_OK, EXIT_REFUSED, EXIT_ERROR = 0, 1, 2
GLOBAL_OPTIONS = ALL_GLOBAL_OPTIONS
TOP_OPTIONS = ("--json", "--watch", "--pretty", "--once", "--demo", "--record", "--version",
               "--help")
#: The subcommands made here, apart from those in :mod:`gputop.cli.subcommands`.
OWN_OPTIONS = {"init-config": ("--stdout",), "completion": ()}


def options() -> dict[str, tuple[str, ...]]:
    """Each subcommand's options as its parser has them (its own, then the global ones it
    takes; never --theme), so completion cannot fall behind the parsers. Read when a
    script is printed, never on a Tab press."""
    import argparse

    from gputop.cli.subcommands import add_subcommands

    sub = add_subcommands(argparse.ArgumentParser(add_help=False))
    out = {name: tuple(s for a in p._actions if a.help != argparse.SUPPRESS
                       for s in a.option_strings if s.startswith("--") and s != "--help")
           for name, p in sub.choices.items()}
    return out | {cmd: (*opts, *for_command(cmd)) for cmd, opts in OWN_OPTIONS.items()}
THEMES = ("gputop-dark", "gputop-light", "gputop-contrast")


def run(args: argparse.Namespace) -> int:
    if args.command == "init-config":
        return init_config(args.config, to_stdout=args.stdout)
    if args.candidates:
        for line in candidates(args.config, args.candidates):
            print(line)
        return EXIT_OK
    if not args.shell:
        print("gputop: completion needs a shell: bash, zsh or fish", file=sys.stderr)
        return EXIT_ERROR
    sys.stdout.write(script(args.shell))
    return EXIT_OK


def init_config(cli_path: str | None, *, to_stdout: bool = False) -> int:
    """Write the example hosts file where gputop will look for it; refuse to overwrite."""
    text = data_path("hosts.example.toml").read_text(encoding="utf-8")
    if to_stdout:
        sys.stdout.write(text)
        return EXIT_OK
    path = find_config(cli_path) or default_config_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # O_EXCL: never overwrite, and never write through a symbolic link.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        print(f"gputop: {path} already exists; not overwritten (see `gputop init-config "
              "--stdout` for the example)", file=sys.stderr)
        return EXIT_REFUSED
    except OSError as exc:
        print(f"gputop: cannot write {path}: {exc.strerror}", file=sys.stderr)
        return EXIT_ERROR
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {path}: edit its [[hosts]], then run gputop")
    return EXIT_OK


def candidates(cli_path: str | None, kind: str) -> list[str]:
    """Words for the shell to offer. A broken or missing config offers nothing (silently:
    this runs on every Tab press)."""
    try:
        config = load_config(cli_path)
    except ConfigError:
        return []
    names = [h.name for h in config.hosts if not config.implicit]
    if kind == "hosts":
        return names
    out = [f"{n}:" for n in names]
    # release: your reservations, whole (over SSH: not a connection per Tab)
    if kind == "mine" and config.reservations.host is None:
        out += _reserved(config.reservations.path, set(names), mine=True)
    return out


def _reserved(path: Path, names: set[str], *, mine: bool) -> list[str]:
    """``HOST:GPU`` of active reservations on configured hosts (the file is shared and
    hostile: only names from the config come back)."""
    from gputop.reservations.filelock import StoreError
    from gputop.reservations.ops import whoami
    from gputop.reservations.store import Store

    try:
        state = Store(path).read()
    except (StoreError, OSError):
        return []
    from gputop.model import utcnow

    me = whoami()[0]
    return sorted({f"{r.host}:{r.gpu}" for r in state.active(utcnow())
                   if r.host in names and (not mine or r.user == me)})


def script(shell: str) -> str:
    opts = options()
    words = {
        "COMMANDS": " ".join(opts),
        "GLOBAL": " ".join(GLOBAL_OPTIONS),
        "TOP": " ".join(TOP_OPTIONS),
        "THEMES": " ".join(THEMES),
    }
    text = {"bash": BASH, "zsh": ZSH, "fish": FISH}[shell]
    if shell == "fish":
        text = text.replace("@FISH_OPTIONS@", _fish_options(opts))
    else:
        cases = "".join(f"        {cmd}) opts=\"{' '.join(names)}\" ;;\n"
                        for cmd, names in opts.items())
        text = text.replace("@CASES@", cases.rstrip("\n"))
        text = text.replace("@COMMANDS_CASE@", "|".join(opts))
    for k, v in words.items():
        text = text.replace(f"@{k}@", v)
    return text


def _fish_options(opts: dict[str, tuple[str, ...]]) -> str:
    lines = []
    for opt in (*GLOBAL_OPTIONS, *TOP_OPTIONS):
        lines.append(f"complete -c gputop -n '__fish_use_subcommand' -l {opt[2:]}")
    for cmd, names in opts.items():
        for opt in names:
            lines.append(f"complete -c gputop -n '__fish_seen_subcommand_from {cmd}' "
                         f"-l {opt[2:]}")
    return "\n".join(lines)


BASH = r"""# gputop completion for bash: eval "$(gputop completion bash)" in ~/.bashrc
_gputop_candidates() {
    command gputop completion --candidates "$@" 2>/dev/null
}
_gputop() {
    local line="${COMP_LINE:0:COMP_POINT}"
    local cur="${line##*[[:space:]]}"
    local prev="${COMP_WORDS[COMP_CWORD-1]}"
    local cmd="" i w
    local -a cfg=()
    for ((i = 1; i < COMP_CWORD; i++)); do
        w="${COMP_WORDS[i]}"
        case "$w" in
            --config) cfg=(--config "${COMP_WORDS[i+1]}") ;;
            --config=*) cfg=("$w") ;;
            @COMMANDS_CASE@) [[ -z "$cmd" ]] && cmd="$w" ;;
        esac
    done
    case "$prev" in
        --config) COMPREPLY=($(compgen -f -- "${COMP_WORDS[COMP_CWORD]}")); return ;;
        --theme) COMPREPLY=($(compgen -W "@THEMES@" -- "$cur")); return ;;
        --interval|--timeout|--for|--note|--count|--min-free-memory) COMPREPLY=(); return ;;
    esac
    local words=""
    if [[ "$cur" == -* ]]; then
        local opts=""
        case "$cmd" in
@CASES@
        esac
        [[ -z "$cmd" ]] && opts="@TOP@ @GLOBAL@"
        words="$opts"
    elif [[ -z "$cmd" ]]; then
        words="@COMMANDS@"
    else
        case "$cmd" in
            reserve) words="$(_gputop_candidates targets "${cfg[@]}")" ;;
            release|extend) words="$(_gputop_candidates mine "${cfg[@]}")" ;;
            completion) words="bash zsh fish" ;;
            *) words="" ;;
        esac
    fi
    COMPREPLY=($(compgen -W "$words" -- "$cur"))
    # bash splits words at ':' (COMP_WORDBREAKS): offer only what follows the last one.
    if [[ "$cur" == *:* && "$COMP_WORDBREAKS" == *:* ]]; then
        local colon="${cur%"${cur##*:}"}"
        local -a kept=()
        for w in "${COMPREPLY[@]}"; do
            w="${w#"$colon"}"
            [[ -n "$w" ]] && kept+=("$w")  # the word typed itself would offer a blank
        done
        COMPREPLY=("${kept[@]}")
    fi
    if [[ ${#COMPREPLY[@]} -eq 1 && "${COMPREPLY[0]}" == *: ]]; then
        compopt -o nospace 2>/dev/null
    fi
}
complete -o default -F _gputop gputop
"""

ZSH = r"""# gputop completion for zsh: eval "$(gputop completion zsh)" in ~/.zshrc
autoload -U +X compinit && compinit
autoload -U +X bashcompinit && bashcompinit
""" + BASH.split("\n", 1)[1]

FISH = r"""# gputop completion for fish:
#   gputop completion fish > ~/.config/fish/completions/gputop.fish
function __gputop_candidates
    command gputop completion --candidates $argv 2>/dev/null
end
complete -c gputop -f
complete -c gputop -n '__fish_use_subcommand' -a '@COMMANDS@'
complete -c gputop -n '__fish_seen_subcommand_from completion' -a 'bash zsh fish'
complete -c gputop -n '__fish_seen_subcommand_from reserve' -a '(__gputop_candidates targets)'
complete -c gputop -n '__fish_seen_subcommand_from release extend' -a '(__gputop_candidates mine)'
complete -c gputop -l config -r -F
complete -c gputop -n '__fish_use_subcommand' -l theme -x -a '@THEMES@'
@FISH_OPTIONS@
"""
