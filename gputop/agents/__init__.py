"""Coding agents' way in: ``gputop mcp``, an MCP server over the same data and rules as the
commands (it may use the data layer, the poller, reservations and jobs; never ui, hub or
cli)."""
