"""The hub (``gputop serve``): one collection for the whole team, served read-only.

``collector`` polls the hosts once and keeps the ``--json`` document and what changed;
``events`` frames those changes as Server-Sent Events; ``metrics`` turns the document into
Prometheus families; ``server`` is the HTTP side (aiohttp) that serves all of them. Nothing
here is imported by the board or the data layer: readers of a hub go through
``gputop.hubclient.client``, which knows the document's schema, not this package.
"""
