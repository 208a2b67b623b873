"""One client cannot take the whole hub: against a real ``gputop serve`` process
(tests/demo_hub.py), each client socket bound to a loopback address of its own, so the
hub sees an attacker (127.0.0.3, .4, .5) and a prober (127.0.0.2) as different peers."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from tests.support.hubs import DemoHub
from tests.test_hub_connections import closed_by_hub

ADDR = "127.0.32.1"
PROBER, ATTACKER = "127.0.0.2", "127.0.0.3"


def connect(port: int, source: str) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect((ADDR, port))
    return s


def ask(port: int, source: str, path: str, headers: str = "",
        via: socket.socket | None = None) -> bytes:
    """One request from ``source`` (or over ``via``, an open socket), the whole answer
    (the connection closes after it): b"" when the hub closed the socket unanswered."""
    s = via or connect(port, source)
    try:
        s.settimeout(10)
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {ADDR}:{port}\r\n{headers}"
                  "Connection: close\r\n\r\n".encode())
        out = b""
        while chunk := s.recv(1 << 16):
            out += chunk
        return out
    except ConnectionResetError:
        return b""
    finally:
        s.close()


def alive(s: socket.socket) -> bool:
    """Whether the hub still holds ``s`` open (nothing to read, no EOF, no reset)."""
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def test_one_client_holding_its_share_leaves_healthy_answering(tmp_path: Path) -> None:
    """One address opens 40 idle sockets against a pool of 32 and reopens each the hub
    closes. Before the per-client cap it held all 32 and a probe from another address
    was closed unanswered until the idle limit; now it holds its 16 and /-/healthy and
    /-/ready from 127.0.0.2 answer every time."""
    h = DemoHub(tmp_path, ADDR, "--hosts", "2", "--gpus", "1", "--max-connections", "32",
                "--first-request-timeout", "60", "--idle-timeout", "60")
    held: list[socket.socket] = []
    try:
        answers = []
        for i in range(12):
            held = [s for s in held if alive(s) or s.close()]
            while len(held) < 40:
                held.append(connect(h.port, ATTACKER))
            time.sleep(0.1)
            answers.append(ask(h.port, PROBER, "/-/healthy" if i % 2 else "/-/ready"))
        assert all(a.startswith(b"HTTP/1.1 200") for a in answers), (answers, h.stderr())
        time.sleep(0.3)
        assert sum(alive(s) for s in held) == 16
    finally:
        for s in held:
            s.close()
        h.stop()


def test_sockets_that_send_no_whole_request_are_closed_after_the_first_request_deadline(
        tmp_path: Path) -> None:
    """Sockets that send nothing, or half a request's headers, were held until the 30 s
    idle limit; now each is closed after --first-request-timeout (1 s here) and counted
    with the other cut connections. One that has asked stays for the idle limit."""
    h = DemoHub(tmp_path, ADDR, "--hosts", "2", "--gpus", "1",
                "--first-request-timeout", "1", "--idle-timeout", "30")
    try:
        silent = [connect(h.port, ATTACKER) for _ in range(3)]
        half = connect(h.port, ATTACKER)
        half.sendall(f"GET /-/healthy HTTP/1.1\r\nHost: {ADDR}".encode())
        asked = connect(h.port, ATTACKER)
        asked.sendall(f"GET /-/healthy HTTP/1.1\r\nHost: {ADDR}:{h.port}\r\n\r\n".encode())
        asked.settimeout(5)
        assert asked.recv(1 << 16).startswith(b"HTTP/1.1 200")
        assert all(closed_by_hub(s, 6) for s in [*silent, half]), h.stderr()
        assert alive(asked)
        assert h.metric("gputop_hub_connections_stalled_total") == 4
        assert "sent no request within 1 s" in h.stderr()
        for s in [*silent, half, asked]:
            s.close()
    finally:
        h.stop()


def test_one_clients_event_streams_are_capped_while_anothers_is_accepted(
        tmp_path: Path) -> None:
    """With the token, one address opens 8 streams (the whole --max-subscribers) that
    read nothing. Before, the next stream from anyone got 503 for as long as they stayed;
    now that address gets 4 and another address's stream is still accepted. The
    refusals are one line on stderr."""
    tf = tmp_path / "token"
    tf.write_text("s3cret\n")
    h = DemoHub(tmp_path, ADDR, "--hosts", "2", "--gpus", "1", "--max-subscribers", "8",
                "--token-file", str(tf))
    auth = "Authorization: Bearer s3cret\r\nLast-Event-ID: 1\r\n"
    streams: list[socket.socket] = []
    try:
        statuses = []
        for _ in range(8):
            s = connect(h.port, ATTACKER)
            s.sendall(f"GET /api/v1/events?patches=1 HTTP/1.1\r\nHost: {ADDR}:{h.port}\r\n"
                      f"{auth}\r\n".encode())
            s.settimeout(10)
            statuses.append(s.recv(12))
            streams.append(s)
        assert statuses.count(b"HTTP/1.1 200") == 4, statuses
        assert statuses.count(b"HTTP/1.1 503") == 4, statuses
        other = connect(h.port, PROBER)
        other.sendall(f"GET /api/v1/events HTTP/1.1\r\nHost: {ADDR}:{h.port}\r\n{auth}\r\n"
                      .encode())
        other.settimeout(10)
        assert other.recv(12) == b"HTTP/1.1 200"
        streams.append(other)
        lines = [x for x in h.stderr().splitlines() if "refused an event stream" in x]
        assert len(lines) == 1 and "--max-subscribers-per-client" in lines[0], h.stderr()
    finally:
        for s in streams:
            s.close()
        h.stop()


def test_per_client_refusals_are_one_line_each_rate_limited(tmp_path: Path) -> None:
    """Past its share each of one address's connections is closed at once, counted in
    gputop_hub_connections_refused_total, and said in one line per 10 s."""
    h = DemoHub(tmp_path, ADDR, "--hosts", "2", "--gpus", "1", "--max-connections", "32")
    held = [connect(h.port, ATTACKER) for _ in range(16)]
    try:
        time.sleep(0.3)
        for _ in range(20):
            with connect(h.port, ATTACKER) as s:
                s.settimeout(5)
                assert s.recv(100) == b""
        assert all(alive(s) for s in held)
        body = ask(h.port, PROBER, "/metrics").decode()
        assert "\ngputop_hub_connections_refused_total 20.0\n" in body, body[-2000:]
    finally:
        for s in held:
            s.close()
        h.stop()
    lines = [x for x in h.stderr().splitlines() if "refused a connection" in x]
    assert len(lines) == 1 and "--max-connections-per-client" in lines[0], h.stderr()


def test_the_reserve_answers_probes_only(tmp_path: Path) -> None:
    """Two addresses fill the pool but its reserve (2 of 32): a third address's
    connections then answer /-/healthy but not the snapshot, so a liveness probe still
    gets through when many addresses hold the hub."""
    h = DemoHub(tmp_path, ADDR, "--hosts", "2", "--gpus", "1", "--max-connections", "32")
    held = [connect(h.port, a) for a in ("127.0.0.4", "127.0.0.5") for _ in range(15)]
    try:
        time.sleep(0.3)
        third = "127.0.0.6"
        assert ask(h.port, third, "/api/v1/snapshot").startswith(b"HTTP/1.1 503")
        assert ask(h.port, third, "/-/healthy").startswith(b"HTTP/1.1 200")
        held[0].close()
        time.sleep(0.3)
        assert ask(h.port, third, "/api/v1/snapshot").startswith(b"HTTP/1.1 200")
    finally:
        for s in held:
            s.close()
        h.stop()
