"""The hub client: reading a hub's snapshot and event stream (checked against its schema,
patched in place) as the board, ``--json`` and ``--watch`` read hosts."""
