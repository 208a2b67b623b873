"""Board themes: TOML files in ``themes/`` (built in) and the user's config dir, loaded into
Textual's Theme API. A broken file is reported and skipped; the board falls back to a theme
that is always there.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import platformdirs
from textual.color import Color, ColorParseError
from textual.theme import Theme

from gputop.config.load import data_path
from gputop.config.values import APP

FALLBACK = "gputop-dark"
STATE_VARIABLES = ("gpu-free", "gpu-busy", "gpu-reserved", "gpu-error", "gpu-muted")
_COLOR_KEYS = ("primary", "secondary", "accent", "foreground", "background", "surface",
               "panel", "boost", "warning", "error", "success")

#: Always available, even with no theme files at all.
BUILTIN = Theme(
    name=FALLBACK, primary="#4FA3E0", secondary="#8B949E", accent="#D2A8FF",
    foreground="#E6EDF3", background="#0D1117", surface="#161B22", panel="#1F2630",
    success="#3FB950", warning="#D29922", error="#F85149", dark=True,
    variables={"gpu-free": "#3FB950", "gpu-busy": "#D29922", "gpu-reserved": "#D2A8FF",
               "gpu-error": "#F85149", "gpu-muted": "#8B949E"},
)


def theme_dirs() -> list[Path]:
    """Built-in themes (the copy a wheel ships in the package, else the source checkout's),
    then the user's own."""
    return [data_path("themes"), Path(platformdirs.user_config_dir(APP)) / "themes"]


@dataclass
class ThemeSet:
    themes: dict[str, Theme] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def parse_theme(data: dict[str, Any], source: str) -> Theme:
    """A Theme from one file's TOML; ValueError names the file and key on any mistake."""
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{source}: 'name' must be a non-empty string")
    kwargs: dict[str, Any] = {}
    for key in _COLOR_KEYS:
        if key in data:
            kwargs[key] = _color(data[key], f"{source}: {key}")
    if "primary" not in kwargs:
        raise ValueError(f"{source}: 'primary' is required")
    dark = data.get("dark", True)
    if not isinstance(dark, bool):
        raise ValueError(f"{source}: 'dark' must be true or false")
    variables = data.get("variables", {})
    if not isinstance(variables, dict):
        raise ValueError(f"{source}: [variables] must be a table")
    merged = dict(BUILTIN.variables)
    for k, v in variables.items():
        merged[str(k)] = _color(v, f"{source}: variables.{k}")
    unknown = set(data) - {"name", "dark", "variables", *_COLOR_KEYS}
    if unknown:
        raise ValueError(f"{source}: unknown key {sorted(unknown)[0]!r}")
    return Theme(name=name, dark=dark, variables=merged, **kwargs)


def _color(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a colour string")
    try:
        Color.parse(value)
    except ColorParseError:
        raise ValueError(f"{where}: {value!r} is not a colour") from None
    return value


def load_themes(dirs: list[Path] | None = None) -> ThemeSet:
    result = ThemeSet(themes={BUILTIN.name: BUILTIN})
    for d in dirs if dirs is not None else theme_dirs():
        if not d.is_dir():
            continue
        for path in sorted(d.glob("*.toml")):
            try:
                theme = parse_theme(tomllib.loads(path.read_text(encoding="utf-8")), str(path))
            except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, ValueError) as exc:
                result.problems.append(f"theme skipped: {exc}" if isinstance(exc, ValueError)
                                       else f"theme skipped: {path}: {exc}")
                continue
            result.themes[theme.name] = theme
    return result
