"""The ``gputop`` command line: options and dispatch (``main``), the subcommands one module
each, the headless outputs, and start-up (``init-config``, completion).

Above every other layer: nothing in gputop imports ``gputop.cli`` but ``__main__``.
"""

from gputop.cli.main import main

__all__ = ["main"]
