"""Real endpoints for the notification tests, each on loopback in a thread of its own: an
aiohttp receiver that records every POST (``/ok``), one that hangs (``/hang``) and one
that answers 500 (``/fail``), and an aiosmtpd SMTP server that keeps every mail."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Got:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    url: str
    got: list[Got] = field(default_factory=list)
    hits: dict[str, int] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def wait_for(self, path: str, n: int = 1, timeout: float = 20.0) -> list[Got]:
        with self.cond:
            self.cond.wait_for(lambda: len([g for g in self.got if g.path == path]) >= n,
                               timeout)
            return [g for g in self.got if g.path == path]


@contextlib.contextmanager
def receiver() -> Iterator[Receiver]:
    loop = asyncio.new_event_loop()
    rec = Receiver("")
    started = threading.Event()
    stop: dict[str, Any] = {}

    async def handle(request: web.Request) -> web.Response:
        path = request.path
        with rec.cond:
            rec.hits[path] = rec.hits.get(path, 0) + 1
        if path.startswith("/hang"):
            await asyncio.sleep(60)
        if path.startswith("/fail"):
            return web.Response(status=500, text="<!channel> broken")
        body = await request.read()
        with rec.cond:
            rec.got.append(Got(path, dict(request.headers), body))
            rec.cond.notify_all()
        return web.Response(text="ok")

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/{tail:.*}", handle)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        rec.url = f"http://127.0.0.1:{port}"
        stop["event"] = asyncio.Event()
        started.set()
        await stop["event"].wait()
        await runner.cleanup()
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    t = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    t.start()
    started.wait(10)
    try:
        yield rec
    finally:
        loop.call_soon_threadsafe(stop["event"].set)
        t.join(5)


@dataclass
class Mailbox:
    host: str
    port: int
    mails: list[Any] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def wait_for(self, n: int = 1, timeout: float = 20.0) -> list[Any]:
        with self.cond:
            self.cond.wait_for(lambda: len(self.mails) >= n, timeout)
            return list(self.mails)


@contextlib.contextmanager
def smtp_server(login: tuple[str, str] | None = None) -> Iterator[Mailbox]:
    """aiosmtpd on loopback; each mail as (envelope sender, recipients, raw bytes). With
    ``login``: AUTH is required and only that user and password pass."""
    import socket

    from aiosmtpd.controller import Controller
    from aiosmtpd.smtp import AuthResult, LoginPassword

    def check(server: Any, session: Any, envelope: Any, mechanism: str,
              data: Any) -> AuthResult:
        ok = isinstance(data, LoginPassword) and login is not None and (
            data.login.decode(), data.password.decode()) == login
        return AuthResult(success=ok)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    box = Mailbox("127.0.0.1", port)

    class Handler:
        async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
            with box.cond:
                box.mails.append((envelope.mail_from, list(envelope.rcpt_tos),
                                  bytes(envelope.original_content or envelope.content)))
                box.cond.notify_all()
            return "250 OK"

    extra: dict[str, Any] = {} if login is None else {
        "authenticator": check, "auth_required": True, "auth_require_tls": False}
    ctl = Controller(Handler(), hostname="127.0.0.1", port=port, **extra)
    ctl.start()
    try:
        yield box
    finally:
        ctl.stop()
