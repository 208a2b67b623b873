"""One formatter per format. Each takes a Notice (plain, possibly hostile text) and gives
the exact bytes to send, escaped for that format and bounded, so that a process name such
as ``<!channel> @here`` or a note with ``<http://evil|click>`` arrives as inert text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from email.message import EmailMessage
from email.policy import SMTP

from gputop.notify.notice import Notice
from gputop.text import clean

MAX_TITLE = 200
MAX_LINE = 500
MAX_LINES = 40
MAX_FIELD = 300
MAX_FIELDS = 40
#: Mentions a chat would act on: ``@here``, ``@channel``, ``@all``, ``@everyone`` and any
#: ``@name`` (a process named after a teammate must not page them).
_MENTION = re.compile(r"@(?=\w)")
_WORD_JOINER = "\u2060"
#: Markdown that would make a link, an image, a heading or emphasis (Mattermost, Teams).
_MARKDOWN = re.compile(r"([\\`*_{}\[\]()#+!|~>-])")


def _bound(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


def title_of(n: Notice) -> str:
    """One printable line (no CR/LF, no control characters), bounded."""
    return _bound(" ".join(clean(n.title).split()), MAX_TITLE)


def lines_of(n: Notice) -> list[str]:
    out = [_bound(clean(line), MAX_LINE) for line in n.lines[:MAX_LINES]]
    if len(n.lines) > MAX_LINES:
        out.append(f"\u2026 and {len(n.lines) - MAX_LINES} more")
    return out


def fields_of(n: Notice) -> dict[str, str]:
    items = sorted(n.fields.items())[:MAX_FIELDS]
    return {_bound(clean(str(k)), 64): _bound(clean(str(v)), MAX_FIELD) for k, v in items}


def plain(n: Notice) -> str:
    """The notice as plain text: its title, then its lines."""
    return "\n".join([title_of(n), *lines_of(n)])


def slack_escape(text: str) -> str:
    """Slack's three escapes (so ``<!channel>``, ``<@U1>``, ``<http://x|y>`` are text),
    and every mention broken by a word joiner."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MENTION.sub("@" + _WORD_JOINER, text)


def markdown_escape(text: str) -> str:
    """Markdown made literal (no links, images, emphasis), angle brackets made entities,
    mentions broken."""
    text = _MARKDOWN.sub(r"\\\1", text)
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MENTION.sub("@" + _WORD_JOINER, text)


@dataclass(frozen=True)
class Payload:
    """What an HTTP channel posts: the body and its type (and ntfy's headers)."""

    body: bytes
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


def _json(doc: object) -> bytes:
    return json.dumps(doc, ensure_ascii=True).encode()


def slack(n: Notice) -> Payload:
    title, lines = slack_escape(title_of(n)), [slack_escape(x) for x in lines_of(n)]
    return Payload(_json({"text": "\n".join([f"*{title}*", *lines]), "mrkdwn": True,
                          "link_names": False, "unfurl_links": False,
                          "unfurl_media": False}))


def mattermost(n: Notice) -> Payload:
    title, lines = markdown_escape(title_of(n)), [markdown_escape(x) for x in lines_of(n)]
    return Payload(_json({"text": "\n".join([f"**{title}**", *lines])}))


def teams(n: Notice) -> Payload:
    """A Teams workflow webhook's Adaptive Card (a workflow also accepts its ``text``)."""
    title, lines = markdown_escape(title_of(n)), [markdown_escape(x) for x in lines_of(n)]
    body = [{"type": "TextBlock", "text": title, "weight": "Bolder", "wrap": True}]
    body += [{"type": "TextBlock", "text": x, "wrap": True} for x in lines]
    card = {"type": "AdaptiveCard", "version": "1.4",
            "$schema": "http://adaptivecards.io/schemas/adaptive-card.json", "body": body}
    return Payload(_json({"type": "message", "text": "\n".join([title, *lines]),
                          "attachments": [{"contentType":
                                           "application/vnd.microsoft.card.adaptive",
                                           "contentUrl": None, "content": card}]}))


def json_payload(n: Notice) -> Payload:
    """The generic webhook: the notice as data, every string JSON-encoded."""
    return Payload(_json({"kind": n.kind, "user": None if n.user is None else clean(n.user),
                          "key": _bound(clean(n.key), MAX_FIELD), "title": title_of(n),
                          "lines": lines_of(n), "fields": fields_of(n)}))


def _header(text: str) -> str:
    """A header value: printable ASCII on one line (ntfy shows it as the title)."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)[:MAX_TITLE]


def ntfy(n: Notice) -> Payload:
    """ntfy's plain publish: the body is the message (never Markdown), the title a header."""
    return Payload("\n".join(lines_of(n) or [title_of(n)]).encode(),
                   "text/plain; charset=utf-8",
                   (("Title", _header(title_of(n))), ("Tags", _header(f"gputop,{n.kind}")),
                    ("Markdown", "no")))


HTTP_FORMATS = {"slack": slack, "mattermost": mattermost, "teams": teams, "json": json_payload,
                "webhook": json_payload, "ntfy": ntfy}


def email(n: Notice, sender: str, to: str) -> EmailMessage:
    """A plain-text mail: no CR/LF in any header (the subject is one cleaned line, encoded
    when not ASCII), the body plain text."""
    msg = EmailMessage(policy=SMTP)
    msg["From"] = sender
    msg["To"] = to
    msg["Subject"] = f"[gputop] {title_of(n)}"
    msg["Auto-Submitted"] = "auto-generated"
    msg.set_content(plain(n) + "\n\n-- \ngputop (gputop notify status lists your routes)\n")
    return msg
