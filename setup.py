"""Build hook: ship the built-in themes and the example hosts file inside the package.

They stay at the top of the source tree (``themes/``, ``hosts.example.toml``), where people
look for them; ``build_py`` copies them to ``gputop/data/`` in every wheel, so a
non-editable ``pip install .``, ``pipx install .`` or ``uv tool install .`` has them.
Everything else is in pyproject.toml.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
SHIPPED = {"themes": "themes", "hosts.example.toml": "hosts.example.toml"}


class BuildWithData(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads them from the checkout
        data = Path(self.build_lib) / "gputop" / "data"
        data.mkdir(parents=True, exist_ok=True)
        themes = data / "themes"
        themes.mkdir(exist_ok=True)
        for src in sorted((HERE / "themes").glob("*.toml")):
            shutil.copyfile(src, themes / src.name)
        shutil.copyfile(HERE / "hosts.example.toml", data / "hosts.example.toml")


setup(cmdclass={"build_py": BuildWithData})
