"""How what the socket layer raises is said: classified, in the resolver's own words."""

from __future__ import annotations

import socket

from gputop.sources.transport import classify_exception


def test_a_name_that_does_not_resolve_says_so_without_errno_numbers() -> None:
    """Not "name resolution failed: [Errno -2] Name or service not known"."""
    real = None
    try:
        socket.getaddrinfo("no-such-host.invalid", 22)
    except socket.gaierror as exc:
        real = exc
    assert real is not None  # (.invalid never resolves: RFC 2606)
    err = classify_exception(real)
    assert err.kind == "unreachable"
    assert err.message.startswith("name resolution failed: ") and "[Errno" not in err.message
    assert err.message == f"name resolution failed: {real.strerror}"
    # One with no words of its own still says something.
    assert classify_exception(socket.gaierror()).message == "name resolution failed: gaierror"
