"""The hub's connections against a real ``gputop serve`` process (tests/support/demo_hub.py: the
hub's own serve() over simulated hosts): clients that stop reading are cut off within
the write deadline, whatever they asked for; a resume from far back costs a snapshot,
not a copy of the retained window; a refusal is one log line."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.hubs import DemoHub, get

ADDR = "127.0.31.1"


def stuck_socket(port: int, request: bytes) -> socket.socket:
    """A client that sends ``request`` and never reads (a small receive buffer)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((ADDR, port))
    s.sendall(request)
    return s


def closed_by_hub(s: socket.socket, within: float = 10.0) -> bool:
    """Whether the hub has closed ``s``: reading what is left ends in EOF or a reset."""
    s.settimeout(within)
    try:
        while s.recv(1 << 20):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


@pytest.fixture
def small_hub(tmp_path: Path) -> Iterator[DemoHub]:
    h = DemoHub(tmp_path, ADDR, "--hosts", "4", "--gpus", "2", "--max-connections", "6",
                "--write-timeout", "1", "--idle-timeout", "5")
    try:
        yield h
    finally:
        h.stop()


def test_pipelined_requests_nobody_reads_do_not_hold_the_hub(small_hub: DemoHub) -> None:
    """Six sockets (the --max-connections bound) each send 400 pipelined requests for
    board.js and never read. On main aiohttp wrote each answer after its handler with no
    deadline: the six held every place and /-/healthy went unanswered for as long as they
    stayed. Now each is closed once its socket takes nothing for --write-timeout, and the
    hub answers again."""
    h = small_hub
    one = f"GET /static/board.js HTTP/1.1\r\nHost: {ADDR}\r\n\r\n".encode()
    stuck = []
    for _ in range(6):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((ADDR, h.port))
        s.setblocking(False)
        try:
            s.sendall(one * 400)
        except BlockingIOError:
            pass  # (the hub reads a bounded queue of requests at a time: enough sent)
        stuck.append(s)
    try:
        answered = False
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not answered:
            try:
                answered = get(h.url + "-/healthy", timeout=2)[0] == 200
            except OSError:
                time.sleep(0.2)
        assert answered, h.stderr()
        assert all(closed_by_hub(s, 5) for s in stuck)
        assert h.metric("gputop_hub_connections_stalled_total") >= 1
    finally:
        for s in stuck:
            s.close()


def test_refusals_are_one_line_each_and_rate_limited(small_hub: DemoHub) -> None:
    """Past --max-connections each connection is closed at once. On main each refusal
    also wrote a seven-line traceback (``Task exception was never retrieved``)."""
    h = small_hub
    held = [socket.create_connection((ADDR, h.port)) for _ in range(6)]
    try:
        time.sleep(0.3)
        for _ in range(40):
            with socket.create_connection((ADDR, h.port)) as s:
                s.settimeout(5)
                assert s.recv(100) == b""
        time.sleep(0.5)
        refused = h.metric("gputop_hub_connections_refused_total", via=held[0])
    finally:
        for s in held:
            s.close()
    err = h.stderr()
    assert "Traceback" not in err and "Task exception" not in err, err
    lines = [x for x in err.splitlines() if "refused a connection" in x]
    assert len(lines) == 1, err  # (one at most per 10 s, with a count of those left out)
    assert refused == 40


def test_streams_resuming_from_far_back_that_never_read_are_closed_and_cost_little(
        tmp_path: Path) -> None:
    """Six event streams with the oldest retained ``Last-Event-ID`` that never read. On
    main each got the retained window copied out for it (a gigabyte at 64 MB of window)
    and kept its socket after being dropped. Now a reader that far behind gets the
    snapshot instead, written a piece at a time, and each connection ends within the
    write deadline; the hub's RSS barely moves."""
    h = DemoHub(tmp_path, ADDR, "--hosts", "60", "--gpus", "8", "--interval", "0.3",
                "--write-timeout", "2", "--retain-mb", "8")
    try:
        sse = socket.create_connection((ADDR, h.port))
        sse.sendall(f"GET /api/v1/events HTTP/1.1\r\nHost: {ADDR}\r\n\r\n".encode())
        sse.settimeout(10)
        head = b""
        while b"\nid: " not in head or not head.split(b"\nid: ", 1)[1].count(b"\n"):
            head += sse.recv(1 << 16)
        sse.close()
        first = head.split(b"\nid: ", 1)[1].split(b"\n", 1)[0].decode()
        epoch, seq = first.split("-")
        deadline = time.monotonic() + 60
        while h.metric("gputop_hub_retained_bytes") < 6 << 20:
            assert time.monotonic() < deadline, "the window never filled"
            time.sleep(0.5)
        before = h.rss_mib()
        old = f"{epoch}-{int(seq) + 1}"  # (the window's oldest, well within it)
        stuck = [stuck_socket(h.port, f"GET /api/v1/events HTTP/1.1\r\nHost: {ADDR}\r\n"
                              f"Last-Event-ID: {old}\r\n\r\n".encode()) for _ in range(6)]
        try:
            peak, deadline = before, time.monotonic() + 30
            while time.monotonic() < deadline:  # (the write deadline is 2 s)
                time.sleep(0.2)
                peak = max(peak, h.rss_mib())
                if h.metric("gputop_hub_connections_stalled_total") >= 6:
                    break
            assert h.metric("gputop_hub_connections_stalled_total") == 6
            assert h.metric("gputop_hub_subscribers") == 0
            assert all(closed_by_hub(s, 5) for s in stuck)
        finally:
            for s in stuck:
                s.close()
        assert peak - before < 24, (before, peak)  # (on main: +70 MiB and more)
    finally:
        h.stop()


# --- the token: a header, never a cookie; tickets for the event stream ---------------------


def test_no_cookie_authenticates_and_a_ticket_opens_one_stream(tmp_path: Path) -> None:
    """On main the page kept the token in a cookie the hub accepted: a browser sends a
    host's cookies to every port of it, so another service there could take and replay
    it. Now nothing sets or reads a cookie; the header is the key, and the event stream's
    ticket (bought with the header) opens that one stream once."""
    import http.client
    import json

    secret = "s3cret-token"
    tf = tmp_path / "token"
    tf.write_text(secret + "\n")
    h = DemoHub(tmp_path, ADDR, "--hosts", "2", "--gpus", "1", "--token-file", str(tf))
    bearer = {"Authorization": f"Bearer {secret}"}
    cookie = {"Cookie": f"gputop_token={secret}"}

    def ask(method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str],
                                                                      bytes]:
        c = http.client.HTTPConnection(ADDR, h.port, timeout=10)
        try:
            c.request(method, path, headers=headers)
            r = c.getresponse()
            if r.status != 200 or not path.startswith("/api/v1/events"):
                return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
            body = b""
            while b"event: snapshot" not in body and (chunk := r.read1(1 << 16)):
                body += chunk  # (a stream: read until its first event)
            return r.status, {k.lower(): v for k, v in r.getheaders()}, body
        finally:
            c.close()

    try:
        seen: list[dict[str, str]] = []
        for method, path, headers in (("GET", "/", {}), ("GET", "/static/board.js", {}),
                                      ("GET", "/api/v1/snapshot", bearer),
                                      ("GET", "/metrics", bearer), ("GET", "/-/healthy", {})):
            status, got, _ = ask(method, path, headers)
            assert status == 200, path
            seen.append(got)
        for path in ("/api/v1/snapshot", "/metrics", "/api/v1/events", "/api/v1/waste"):
            assert ask("GET", path, cookie)[0] == 401, path
        assert ask("POST", "/api/v1/ticket", cookie)[0] == 401
        status, got, body = ask("POST", "/api/v1/ticket", bearer)
        assert status == 200
        seen.append(got)
        ticket = json.loads(body)["ticket"]
        assert ask("GET", f"/api/v1/snapshot?ticket={ticket}", {})[0] == 401  # one purpose
        status, _, body = ask("GET", f"/api/v1/events?ticket={ticket}", {})
        assert status == 200 and b"event: snapshot" in body
        assert ask("GET", f"/api/v1/events?ticket={ticket}", {})[0] == 401  # spent
        assert ask("GET", "/api/v1/events?ticket=made-up", {})[0] == 401
        assert all("set-cookie" not in got for got in seen)
    finally:
        h.stop()
