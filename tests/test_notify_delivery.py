"""Notices said and delivered against real endpoints (an aiohttp receiver and aiosmtpd on
loopback, started once for the module): hostile text arrives inert in every format, a
hanging or failing endpoint delays nothing else and is given up on, counted."""

from __future__ import annotations

import email
import email.policy
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from notify_servers import Mailbox, Receiver, receiver, smtp_server

from gputop.config import ConfigError, load_config
from gputop.errors import GputopError
from gputop.notify.delivery import Notifier, read_status
from gputop.notify.notice import Notice, Route
from gputop.notify_config import NotifyConfig, NotifyConfigError

HOSTILE_PROC = "<!channel> @here\r\nBcc: x@evil.example"
HOSTILE_NOTE = "see <http://evil.example|click> [here](http://evil.example) <@U123>"


@pytest.fixture(scope="module")
def rec() -> Iterator[Receiver]:
    with receiver() as r:
        yield r


@pytest.fixture(scope="module")
def mailbox() -> Iterator[Mailbox]:
    with smtp_server() as m:
        yield m


def _notice(user: str | None, key: str = "k") -> Notice:
    return Notice("unreserved-use", user, key, f"{HOSTILE_PROC} runs on gpu-01:0",
                  (f"process: {HOSTILE_PROC}", f"note: {HOSTILE_NOTE}"),
                  {"process": HOSTILE_PROC, "note": HOSTILE_NOTE})


def _secret(tmp_path: Path, name: str, text: str, mode: int = 0o600) -> Path:
    p = tmp_path / name
    p.write_text(text)
    p.chmod(mode)
    return p


def _run(config: NotifyConfig, notices: list[Notice], routes: dict[str, list[Route]],
         status: Path | None = None) -> Notifier:
    n = Notifier(config, lambda u: routes.get(u, []), status_file=status).start()
    try:
        for x in notices:
            n.submit(x)
        assert n.wait_idle(30)
    finally:
        n.close()
    return n


def _inert_chat(text: str, markdown: bool) -> None:
    """No Slack control sequence, no mention; in Markdown formats no link either (Slack's
    mrkdwn has no ``[x](url)`` links)."""
    assert "<!channel>" not in text and "<http" not in text and "<@U" not in text
    assert "@here" not in text and (not markdown or "](http" not in text)
    assert "\r" not in text and "Bcc: x@evil.example\n" not in text


@pytest.mark.parametrize("fmt", ["slack", "mattermost", "teams"])
def test_hostile_text_arrives_inert_in_chat_formats(fmt: str, rec: Receiver,
                                                    tmp_path: Path) -> None:
    path = f"/ok/{fmt}"
    url = _secret(tmp_path, "team", rec.url + path + "\n")
    cfg = NotifyConfig(team_webhook_file=url, team_format=fmt)
    n = _run(cfg, [_notice(None)], {})
    got = rec.wait_for(path)
    assert len(got) == 1 and n.counters.snapshot() == {(fmt, "sent"): 1}
    doc = json.loads(got[0].body)
    texts = [doc["text"]]
    if fmt == "teams":
        card = doc["attachments"][0]["content"]
        assert card["type"] == "AdaptiveCard"
        texts += [b["text"] for b in card["body"]]
    for t in texts:
        _inert_chat(t, fmt != "slack")
    assert "evil.example" in doc["text"]  # said, not dropped


def test_json_and_ntfy_carry_the_text_encoded(rec: Receiver) -> None:
    routes = {"ann": [Route("webhook", rec.url + "/ok/json"), Route("ntfy", rec.url
                                                                    + "/ok/ntfy")]}
    _run(NotifyConfig(), [_notice("ann")], routes)
    doc = json.loads(rec.wait_for("/ok/json")[0].body)
    assert doc["user"] == "ann" and doc["kind"] == "unreserved-use"
    assert doc["fields"]["note"] == HOSTILE_NOTE  # exactly the text, as JSON data
    assert doc["fields"]["process"] == "<!channel> @here  Bcc: x@evil.example"  # no CR/LF
    got = rec.wait_for("/ok/ntfy")[0]
    assert "\n" not in got.headers["Title"] and got.headers["Markdown"] == "no"
    assert b"evil.example" in got.body


def test_mail_has_no_injected_header_and_goes_to_its_route_only(mailbox: Mailbox) -> None:
    cfg = NotifyConfig(sender="gputop@lab.example", smtp_host=mailbox.host,
                       smtp_port=mailbox.port)
    before = len(mailbox.mails)
    _run(cfg, [_notice("ann")], {"ann": [Route("email", "ann@lab.example")]})
    sender, rcpts, raw = mailbox.wait_for(before + 1)[-1]
    assert rcpts == ["ann@lab.example"] and sender == "gputop@lab.example"
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    assert msg["Bcc"] is None and msg["To"] == "ann@lab.example"
    assert "\n" not in str(msg["Subject"]) and "evil.example" in str(msg["Subject"])
    assert msg.get_content_type() == "text/plain"
    assert all(not k.lower().startswith("bcc") for k in msg)


def test_a_hanging_and_a_failing_endpoint_delay_nothing_else(rec: Receiver) -> None:
    cfg = NotifyConfig(attempts=2, retry_s=0.05, timeout_s=2)
    routes = {"hung": [Route("webhook", rec.url + "/hang/1")],
              "fails": [Route("webhook", rec.url + "/fail/1")],
              "fine": [Route("webhook", rec.url + "/ok/fine")]}
    n = Notifier(cfg, lambda u: routes[u]).start()
    try:
        for user in ("hung", "fails", "fine"):
            n.submit(_notice(user, key=user))
        assert len(rec.wait_for("/ok/fine")) == 1
        # the fine one arrived while the hung one is still on its first try
        assert not [d for d in n.last() if "/hang/" in d.target]
        assert n.wait_idle(30)
    finally:
        n.close()
    counts = n.counters.snapshot()
    assert counts[("webhook", "sent")] == 1 and counts[("webhook", "failed")] == 2
    assert counts[("webhook", "retried")] == 2
    assert rec.hits["/fail/1"] == 2 and rec.hits["/hang/1"] == 2  # gave up at the limit
    results = {d.target: (d.result, d.attempts) for d in n.last()}
    assert results[rec.url + "/fail/1"] == ("failed", 2)
    assert 'result="failed"' in n.counters.prometheus()


def test_a_full_queue_drops_the_oldest_or_refuses_counted() -> None:
    n = Notifier(NotifyConfig(queue=2), lambda u: [])  # not started: nothing leaves
    for i in range(3):
        n.submit(_notice("ann", key=str(i)))
    assert n.counters.snapshot() == {("queue", "dropped"): 1}
    n = Notifier(NotifyConfig(queue=2, overflow="refuse"), lambda u: [])
    for i in range(3):
        n.submit(_notice("ann", key=str(i)))
    assert n.counters.snapshot() == {("queue", "refused"): 1}


def test_secrets_readable_by_others_are_refused(rec: Receiver, mailbox: Mailbox,
                                                tmp_path: Path) -> None:
    team = _secret(tmp_path, "team", rec.url + "/ok/leaky\n", 0o644)
    auth = _secret(tmp_path, "smtp", "user\npass\n", 0o640)
    cfg = NotifyConfig(team_webhook_file=team, sender="g@lab.example",
                       smtp_host=mailbox.host, smtp_port=mailbox.port, smtp_auth_file=auth)
    status = tmp_path / "status.json"
    n = _run(cfg, [_notice(None), _notice("ann")],
             {"ann": [Route("email", "ann@lab.example")]}, status)
    errors = [d.error for d in n.last()]
    assert len(errors) == 2 and all("readable by group or others" in e for e in errors)
    assert rec.hits.get("/ok/leaky") is None
    assert [d["result"] for d in read_status(status)] == ["failed", "failed"]


def test_the_notify_table_is_parsed_and_checked(tmp_path: Path) -> None:
    cfg = tmp_path / "hosts.toml"
    base = ('hosts = ["h"]\n[notify]\nfrom = "gputop@lab.example"\n'
            'smtp = "smtp.lab.example:587"\nsmtp_auth_file = "/etc/gputop/smtp"\n'
            'team_webhook_file = "/etc/gputop/team"\nteam_format = "slack"\n'
            'expiry_warning = "15m"\n')
    cfg.write_text(base)
    n = load_config(str(cfg)).notify
    assert (n.sender, n.smtp_host, n.smtp_port, n.team_format) == (
        "gputop@lab.example", "smtp.lab.example", 587, "slack")
    assert n.expiry_warning_s == 900 and n.team_webhook_file == Path("/etc/gputop/team")
    for extra, key in (('colour = "red"\n', "notify.colour"),
                       ('team_webhook = "https://hooks.slack.com/x"\n', "notify.team_webhook"),
                       ('team_format = "irc"\n', "notify.team_format"),
                       ('expiry_warning = "soon"\n', "notify.expiry_warning")):
        kept = base.replace('team_format = "slack"\n', "").replace('expiry_warning = "15m"\n',
                                                                   "")
        cfg.write_text(kept + extra)
        with pytest.raises((NotifyConfigError, ConfigError)) as exc:
            load_config(str(cfg))
        assert str(cfg) in str(exc.value) and key in str(exc.value)
        assert isinstance(exc.value, GputopError) and exc.value.exit_code == 2


def test_notify_test_and_status_from_the_command_line(rec: Receiver, tmp_path: Path) -> None:
    cfg = tmp_path / "hosts.toml"
    cfg.write_text(f'hosts = ["h"]\n[reservations]\npath = "{tmp_path / "r.json"}"\n'
                   f'[history]\npath = "{tmp_path / "h.sqlite3"}"\n[notify]\nattempts = 1\n')

    def gputop(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gputop", "--config", str(cfg), *args],
                              capture_output=True, text=True, timeout=60,
                              env=os.environ | {"PYTHONPATH": str(Path.cwd())})

    r = gputop("notify", "test")
    assert r.returncode != 0 and "no route" in r.stderr
    r = gputop("notify", "me", "--webhook", rec.url + "/ok/cli")
    assert r.returncode == 0, r.stderr
    r = gputop("notify", "test")
    assert r.returncode == 0 and "webhook" in r.stdout and "sent" in r.stdout, r.stderr
    assert json.loads(rec.wait_for("/ok/cli")[0].body)["kind"] == "test"
    r = gputop("notify", "status")
    assert r.stdout.count(rec.url + "/ok/cli") == 2 and "sent" in r.stdout, r.stdout
    r = gputop("notify", "me", "--email", "not an address\r\nBcc: x")
    assert r.returncode == 2 and "not an e-mail address" in r.stderr
    assert replace(load_config(str(cfg)).notify, attempts=1).attempts == 1


def test_a_hung_route_with_a_long_backlog_holds_back_no_other_route(rec: Receiver) -> None:
    """More notices for a hung endpoint than there are delivery slots: the others still
    go, and the hung route's backlog beyond its bound is dropped, counted."""
    from gputop.notify.delivery import MAX_INFLIGHT, MAX_ROUTE_BACKLOG

    routes = {"hung": [Route("webhook", rec.url + "/hang/2")],
              "fine": [Route("webhook", rec.url + "/ok/after-backlog")]}
    n = Notifier(NotifyConfig(attempts=1, timeout_s=30), lambda u: routes[u]).start()
    try:
        for i in range(MAX_INFLIGHT + MAX_ROUTE_BACKLOG):
            n.submit(_notice("hung", key=str(i)))
        n.submit(_notice("fine"))
        assert len(rec.wait_for("/ok/after-backlog")) == 1
        assert rec.hits["/hang/2"] == 1
    finally:
        n.close(1)
    assert n.counters.snapshot().get(("webhook", "dropped"), 0) >= 1


@pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")
def test_mail_logs_in_with_the_owner_only_auth_file(tmp_path: Path) -> None:
    with smtp_server(login=("gputop", "S3cret pass")) as box:
        cfg = NotifyConfig(sender="gputop@lab.example", smtp_host=box.host,
                           smtp_port=box.port, attempts=1, timeout_s=3,
                           smtp_auth_file=_secret(tmp_path, "smtp", "gputop\nS3cret pass\n"))
        n = _run(cfg, [_notice("ann")], {"ann": [Route("email", "ann@lab.example")]})
        assert [d.result for d in n.last()] == ["sent"]
        assert box.wait_for(1)[0][1] == ["ann@lab.example"]
        wrong = replace(cfg, smtp_auth_file=_secret(tmp_path, "bad", "gputop\nwrong\n"))
        n = _run(wrong, [_notice("ann")], {"ann": [Route("email", "ann@lab.example")]})
        assert [d.result for d in n.last()] == ["failed"]
        assert len(box.mails) == 1  # the wrong password sent nothing


def test_the_senders_notifier_reads_each_persons_route_from_the_store(
        rec: Receiver, tmp_path: Path) -> None:
    from gputop.notify.delivery import start_notifier, status_path
    from gputop.notify.routes import set_route
    from gputop.reservations.ops import whoami
    from gputop.sources.shared_file import open_store

    cfg = tmp_path / "hosts.toml"
    cfg.write_text(f'hosts = ["h"]\n[reservations]\npath = "{tmp_path / "r.json"}"\n'
                   f'[history]\npath = "{tmp_path / "h.sqlite3"}"\n')
    config = load_config(str(cfg))
    store = open_store(config)
    me = whoami(store)[0]
    set_route(store, "webhook", rec.url + "/ok/from-store")
    n = start_notifier(config, store)
    try:
        n.submit(_notice(me))
        n.submit(_notice("nobody-here"))
        assert n.wait_idle(30)
    finally:
        n.close()
    assert json.loads(rec.wait_for("/ok/from-store")[0].body)["user"] == me
    assert n.counters.snapshot() == {("webhook", "sent"): 1, ("none", "no-route"): 1}
    path = status_path(config.notify, config.history_path)
    assert path == tmp_path / "notify-status.json"
    assert [(d["user"], d["result"]) for d in read_status(path)] == [(me, "sent")]
