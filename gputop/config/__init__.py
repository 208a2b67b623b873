"""``hosts.toml``: ``load_config`` gives a ``Config`` with one attribute per table
(``config.defaults.interval``, ``config.reservations.path``, ``config.hub.url``, ...).

``values`` holds the checks every table shares, ``tables`` one dataclass per table (its
defaults and its parser), ``load`` finding and reading the file, ``notify`` the ``[notify]`` table.
"""
