"""Carrying a formatted notice: HTTP POST (aiohttp: bounded time and answer, TLS verified,
no redirects) and SMTP (STARTTLS when the server offers it; auth from a private file).
Failures are DeliveryError with a short, clean reason; the caller retries."""

from __future__ import annotations

import asyncio
import os
import smtplib
import ssl
import stat
from email.message import EmailMessage
from pathlib import Path

from gputop.errors import GputopError
from gputop.text import excerpt

#: The most of an endpoint's answer read (it is only looked at for an error message).
MAX_ANSWER = 16 * 1024
#: A secret's file larger than this is no secret's file.
MAX_SECRET = 4096


class DeliveryError(GputopError):
    """One try failed; ``retry``: whether trying again may help (a 4xx will not)."""

    def __init__(self, message: str, *, retry: bool = True) -> None:
        super().__init__(message)
        self.retry = retry


def read_secret(path: Path) -> str:
    """A secret from a file that only its owner may read: one that group or others can
    read is refused with a clear error (it would leak the secret to the team)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise DeliveryError(f"{path}: cannot read it ({exc.strerror})", retry=False) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DeliveryError(f"{path}: not a regular file", retry=False)
        if st.st_mode & 0o077:
            raise DeliveryError(f"{path}: readable by group or others (mode "
                                f"{stat.S_IMODE(st.st_mode):04o}); refusing to use a secret "
                                f"others can read: chmod 600 {path}", retry=False)
        data = os.read(fd, MAX_SECRET + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET:
        raise DeliveryError(f"{path}: larger than {MAX_SECRET} bytes", retry=False)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise DeliveryError(f"{path}: not UTF-8 text", retry=False) from None


def smtp_auth(path: Path) -> tuple[str, str]:
    """The user and password lines of an auth file (see ``read_secret``)."""
    lines = read_secret(path).splitlines()
    if len(lines) < 2 or not lines[0] or not lines[1]:
        raise DeliveryError(f"{path}: expected two lines, the user and the password",
                            retry=False)
    return lines[0], lines[1]


async def http_post(url: str, body: bytes, content_type: str,
                    headers: tuple[tuple[str, str], ...] = (), *, timeout: float) -> int:
    """POST ``body`` to ``url``; the answer's status, or DeliveryError. The whole try,
    connection and answer included, takes at most ``timeout``; certificates are verified
    (aiohttp's default context); a redirect is a failure (a webhook does not move)."""
    import aiohttp

    limit = aiohttp.ClientTimeout(total=timeout)
    try:
        async with aiohttp.ClientSession(timeout=limit) as session, session.post(
                url, data=body, allow_redirects=False,
                headers={"Content-Type": content_type, "User-Agent": "gputop",
                         **dict(headers)}) as resp:
            await resp.content.read(MAX_ANSWER)  # (read, bounded, and dropped)
            if 200 <= resp.status < 300:
                return resp.status
            # The status alone: an answer's body is the endpoint's to say, and the record
            # of deliveries is readable by others (a route at an internal service would
            # read it back through it).
            raise DeliveryError(f"HTTP {resp.status}",
                                retry=resp.status >= 500 or resp.status == 429)
    except (asyncio.TimeoutError, TimeoutError):
        raise DeliveryError(f"no answer within {timeout:g}s") from None
    except aiohttp.ClientError as exc:
        # The kind of failure, never its text: aiohttp's names the URL (a team webhook's
        # URL is a secret).
        raise DeliveryError(type(exc).__name__) from None


def _smtp_send(host: str, port: int, msg: EmailMessage, auth: tuple[str, str] | None,
               timeout: float) -> None:
    with smtplib.SMTP(host, port, timeout=timeout) as s:
        s.ehlo()
        if s.has_extn("starttls"):
            s.starttls(context=ssl.create_default_context())
            s.ehlo()
        if auth is not None:
            s.login(*auth)
        s.send_message(msg)


async def smtp_send(host: str, port: int, msg: EmailMessage, *, auth_file: Path | None,
                    timeout: float) -> None:
    """Send one mail (in a thread: smtplib blocks), within ``timeout`` a step."""
    auth = smtp_auth(auth_file) if auth_file is not None else None
    try:
        await asyncio.wait_for(asyncio.to_thread(_smtp_send, host, port, msg, auth, timeout),
                               timeout * 4)
    except (asyncio.TimeoutError, TimeoutError):
        raise DeliveryError(f"{host}:{port}: no answer within {timeout:g}s") from None
    except smtplib.SMTPResponseException as exc:
        raise DeliveryError(excerpt(f"{host}:{port}: {exc.smtp_code} {exc.smtp_error!r}",
                                    160), retry=exc.smtp_code >= 400 and
                            exc.smtp_code < 500) from None
    except (smtplib.SMTPException, OSError, ssl.SSLError) as exc:
        raise DeliveryError(excerpt(f"{host}:{port}: {exc}", 160)) from None
