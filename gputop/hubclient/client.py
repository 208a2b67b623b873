"""Reading a hub (``gputop serve``): its snapshot and its event stream, as remote output.

A hub is another machine's process: everything it sends is checked like any host's
output. A body or an event line larger than ``MAX_DOCUMENT_BYTES`` is cut off while it is
read; the JSON must parse (no ``NaN``, bounded nesting) and match the shipped snapshot
schema (``gputop/schema/snapshot.schema.json``: its host objects, most of every
document, by a hand-written check, ``gputop.hubclient.hosts``; the rest by a small
validator of the subset it uses, ``gputop.hubclient.schema``), and every string is
cleaned again, as if it came straight from a host.
What fails is one :class:`HubError` with a classified kind (``unreachable``, ``timeout``,
``auth``, ``parse``, ``error``) and the hub's URL, never a hang: every read has a timeout.

This module knows the document, not the server: ``gputop.hub`` is never imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, cast

from gputop.hubclient.hosts import check_hosts
from gputop.hubclient.patch import Touched, apply_changes, check_changes, check_places
from gputop.hubclient.schema import MAX_ITEMS, check, schema
from gputop.hubclient.schema import SchemaError as _Invalid
from gputop.model import (
    SCHEMA_VERSION,
    FleetSnapshot,
    GpuInfo,
    HostError,
    HostSnapshot,
    MigInstance,
    ProcessInfo,
)
from gputop.sources import HubError
from gputop.text import clean, excerpt

#: The largest document or event this reader takes (a 1,000 x 8 fleet is about 6 MB).
MAX_DOCUMENT_BYTES = 64 * 1024 * 1024
#: With no event (an update or a keepalive, every 15 s at most) for this long, the stream
#: is taken for dead and reopened.
STREAM_IDLE_S = 40.0


# --- checking what a hub sends ---------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise _Invalid(f"{name} is not JSON")


def parse_json(raw: bytes | str) -> Any:
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise _Invalid("nested too deep") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _Invalid(f"not JSON: {excerpt(str(exc), 80)}") from None


def check_document(doc: Any) -> dict[str, Any]:
    """A whole ``--json`` document, checked (and its strings cleaned)."""
    if not isinstance(doc, dict):
        raise _Invalid("$: expected an object")
    if doc.get("version") != SCHEMA_VERSION:
        raise _Invalid(f"$.version: expected {SCHEMA_VERSION} (this gputop reads schema "
                       f"{SCHEMA_VERSION}; is the hub another version?)")
    if "hosts" not in doc:
        return cast(dict[str, Any], check(doc))  # (it names what is missing)
    # The hosts (most of it) by the hand-written check; the rest by the schema's.
    rest = cast(dict[str, Any], check({**doc, "hosts": []}))
    rest["hosts"] = check_hosts(doc["hosts"], "$.hosts")
    names = [h["name"] for h in rest["hosts"]]
    if len(set(names)) != len(names):
        # (A reader keeps hosts by name: a second "a" would be left in its order when an
        # update removes "a", and every later update would fail on it.)
        raise _Invalid("$.hosts: a host name appears twice")
    return {k: rest[k] for k in doc}


def check_update(update: Any) -> dict[str, Any]:
    """An ``update`` event: ``time``, complete ``hosts``, ``removed`` names, ``set`` keys."""
    if not isinstance(update, dict) or set(update) != {"time", "hosts", "removed", "set"}:
        raise _Invalid("update: expected the keys hosts, removed, set, time")
    top = schema()["properties"]
    removed = update["removed"]
    if not isinstance(removed, list) or not all(isinstance(n, str) for n in removed):
        raise _Invalid("update.removed: expected an array of strings")
    out: dict[str, Any] = {
        "time": check(update["time"], "time", "update.time"),
        "hosts": check_hosts(update["hosts"], "update.hosts"),
        "removed": [clean(n) for n in removed[:MAX_ITEMS]],
    }
    if not isinstance(update["set"], dict):
        raise _Invalid("update.set: expected an object")
    moved = {}
    for k, v in update["set"].items():
        if k in ("version", "time", "hosts") or k not in top:
            raise _Invalid(f"update.set: unknown key {excerpt(str(k), 40)!r}")
        moved[k] = None if v is None else check(v, k, f"update.set.{k}")
    out["set"] = moved
    return out


def check_patch(patch: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A ``patch`` event (``?patches=1``): the ``update`` it carries (``time``, complete
    ``hosts``, ``removed``, ``set``) and its ``changes`` (``hub_patch``), both checked."""
    if not isinstance(patch, dict) or set(patch) != {"time", "hosts", "changes", "removed",
                                                     "set"}:
        raise _Invalid("patch: expected the keys changes, hosts, removed, set, time")
    changes = check_changes(patch["changes"])
    return check_update({k: patch[k] for k in ("time", "hosts", "removed", "set")}), changes


class Document:
    """A hub's document as a reader keeps it: a snapshot, then updates applied to it."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.order = [h["name"] for h in doc["hosts"]]
        self.hosts = {h["name"]: h for h in doc["hosts"]}
        #: Each host's model as last built, whose unchanged GPUs a patch reuses.
        self.models: dict[str, HostSnapshot] = {}

    def apply(self, update: dict[str, Any]) -> list[dict[str, Any]]:
        """Apply a checked update; returns the hosts it changed: those the document now
        holds, each once (not one the update also removes, nor the first of a name it
        carries twice: no snapshot of the document has them)."""
        for h in update["hosts"]:
            if h["name"] not in self.hosts:
                self.order.append(h["name"])
            self.hosts[h["name"]] = h
        gone = {name for name in update["removed"] if self.hosts.pop(name, None) is not None}
        if gone:  # (one pass: removing each from the order was hosts x removed)
            self.order = [n for n in self.order if n not in gone]
            for name in gone:  # (a hub that adds and removes hosts: no model kept for
                self.models.pop(name, None)  # each name it ever sent)
        for k, v in update["set"].items():
            if v is None:
                self.doc.pop(k, None)
            else:
                self.doc[k] = v
        self.doc["time"] = update["time"]
        self.doc["hosts"] = [self.hosts[n] for n in self.order]
        hosts = self.hosts
        return [held for h in update["hosts"]
                if (held := hosts.get(h["name"])) is not None and held is h]

    def apply_patch(self, update: dict[str, Any], changes: list[dict[str, Any]]
                    ) -> list[Touched]:
        """Apply a checked patch (``hub_patch.check_patch``): its complete hosts, then its
        changes; returns each host it touched, with its changed GPUs' keys by position
        (None: complete)."""
        incoming = {h["name"]: h for h in update["hosts"]}
        removed = set(update["removed"])

        def host(name: str) -> dict[str, Any] | None:  # (as it is once the update applies)
            if name in removed:
                return None
            return incoming.get(name) or self.hosts.get(name)

        check_places(host, changes)  # (before anything is applied: whole or not at all)
        whole = self.apply(update)
        touched = apply_changes(self.hosts, changes)
        if touched:
            self.doc["hosts"] = [self.hosts[n] for n in self.order]
        names = {h["name"] for h in whole}
        patched = {h["name"] for h, _ in touched}
        return [*((h, None) for h in whole if h["name"] not in patched),
                *((h, None if h["name"] in names else pos) for h, pos in touched)]

    def model(self, h: dict[str, Any], changed: dict[int, dict[str, Any]] | None = None
              ) -> HostSnapshot:
        """The host as the model, kept; with ``changed``, only those GPUs built anew."""
        prev = self.models.get(h["name"]) if changed is not None else None
        snap = self.models[h["name"]] = host_from_dict(h, prev, changed)
        return snap


# --- the document as the model -------------------------------------------------------------


def _time(text: str | None) -> datetime | None:
    """A checked ``...Z`` time (most of a document's share a few seconds: cached)."""
    if text is None:
        return None
    t = _TIMES.get(text)
    if t is None:
        if len(_TIMES) > 1024:
            _TIMES.clear()
        t = _TIMES[text] = datetime.fromisoformat(text[:-1]).replace(tzinfo=timezone.utc)
    return t


_TIMES: dict[str, datetime] = {}
_PROCESS_DEFAULTS = {"elapsed_s": None, "gpu_instance_id": None, "compute_instance_id": None}
#: What the schema lets a GPU object hold that is not a GpuInfo field (its annotations).
_GPU_ANNOTATIONS = tuple(set(schema()["$defs"]["gpu"]["properties"])
                         - set(GpuInfo.__dataclass_fields__))
assert set(schema()["$defs"]["process"]["properties"]) <= set(ProcessInfo.__dataclass_fields__)
#: A GPU's fields whose value in the document is the model's own (numbers, strings).
_PLAIN_GPU_FIELDS = frozenset(GpuInfo.__dataclass_fields__) - {"processes", "instances"}
_PATCH_FAST = _PLAIN_GPU_FIELDS | frozenset(_GPU_ANNOTATIONS)


def _process(p: dict[str, Any]) -> ProcessInfo:
    # (Built without the dataclass's __init__: a 200-host document has thousands.)
    q = object.__new__(ProcessInfo)
    q.__dict__.update(_PROCESS_DEFAULTS)
    q.__dict__.update(p)  # (the schema's process keys are ProcessInfo's fields)
    return q


def _gpu_patched(g: dict[str, Any], prev: GpuInfo, changed: dict[str, Any]) -> GpuInfo:
    """The model of a patched GPU: ``prev`` (its model before) with the patch's changed
    keys, where they are all plain fields (load, memory, power: most patches) or
    annotations (which the model leaves out); else built from ``g``, the patched dict."""
    if not changed.keys() <= _PATCH_FAST:
        return _gpu(g)
    q = object.__new__(GpuInfo)
    d = q.__dict__
    d.update(prev.__dict__)
    if changed.keys() <= _PLAIN_GPU_FIELDS:  # (no annotation among them: most patches)
        d.update(changed)
        return q
    for k, v in changed.items():
        if k in _PLAIN_GPU_FIELDS:
            d[k] = v
    return q


def _gpu(g: dict[str, Any]) -> GpuInfo:
    fields = dict(g)
    for k in _GPU_ANNOTATIONS:  # (the schema allows nothing else that is not a field)
        fields.pop(k, None)
    fields["processes"] = tuple(_process(p) for p in g["processes"])
    fields["instances"] = tuple(MigInstance(
        gpu_instance_id=i["gpu_instance_id"], compute_instance_id=i["compute_instance_id"],
        device_index=i.get("device_index"), uuid=i["uuid"], profile=i["profile"],
        memory_used_mib=i["memory_used_mib"], memory_total_mib=i["memory_total_mib"],
        utilization_percent=None, processes=tuple(_process(p) for p in i["processes"]))
        for i in g.get("instances", ()))
    return GpuInfo.from_fields(fields)


def host_from_dict(h: dict[str, Any], prev: HostSnapshot | None = None,
                   changed: dict[int, dict[str, Any]] | None = None) -> HostSnapshot:
    """A checked host object as the model (its reservations and flags are the reader's own
    to work out, from its own reservations file). With ``prev`` (the model of this host
    before a patch) and ``changed`` (the keys the patch changed, by GPU position), the
    other GPUs are ``prev``'s own objects."""
    err = h["error"]
    if err is not None:
        gpus: tuple[GpuInfo, ...] = ()
    elif (prev is not None and changed is not None and prev.error is None
            and len(prev.gpus) == len(h["gpus"])):
        listed = list(prev.gpus)
        for i, keys in changed.items():
            listed[i] = _gpu_patched(h["gpus"][i], listed[i], keys)
        gpus = tuple(listed)
    else:
        gpus = tuple(_gpu(g) for g in h["gpus"])
    # (Built without the frozen dataclass's __init__, as GpuInfo.from_fields: one per
    # changed host per refresh.)
    snap = object.__new__(HostSnapshot)
    snap.__dict__.update(
        name=h["name"], time=_time(h.get("time")) or datetime.now(timezone.utc),
        gpus=gpus,
        error=None if err is None else HostError(err["kind"], err["message"]),
        last_ok=_time(h.get("last_ok")), source=h.get("source", "ssh"),
        tags=tuple(h.get("tags", ())), warnings=tuple(h.get("warnings", ())),
        first_sample_s=h.get("first_sample_s"))
    return snap


#: What host_from_dict sets: every field of the model (a field added there must be here).
assert set(HostSnapshot.__dataclass_fields__) == {
    "name", "time", "gpus", "error", "last_ok", "source", "tags", "warnings", "first_sample_s"}


def fleet_from_document(doc: dict[str, Any]) -> FleetSnapshot:
    return FleetSnapshot(hosts=tuple(host_from_dict(h) for h in doc["hosts"]),
                         time=_time(doc["time"]) or datetime.now(timezone.utc))


# --- HTTP ----------------------------------------------------------------------------------


def read_token(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise OSError(f"{path}: cannot read the hub token: {exc}") from None
    token = text.splitlines()[0].strip() if text else ""
    if not token or not token.isprintable() or len(token) > 4096:
        raise OSError(f"{path}: the hub token file must hold one line of text")
    return token


class HubClient:
    """One hub: its snapshot (``snapshot``) and its event stream (``stream``).

    One look (``snapshot``) goes through the standard library's ``http.client`` on a
    worker thread: a one-shot ``--json`` or ``free`` then never imports aiohttp (a third
    of a second of start-up, the most of what such a command costs through a hub). The
    stream, which lives as long as the board, uses aiohttp on the caller's loop."""

    def __init__(self, url: str, *, timeout: float, token: str | None = None) -> None:
        self.url = url if url.endswith("/") else url + "/"
        self.timeout = timeout
        self.headers = {"Accept": "application/json"}
        if token is not None:
            self.headers["Authorization"] = f"Bearer {token}"
        self._session: Any = None

    def _open(self) -> Any:
        import aiohttp

        if self._session is None or self._session.closed:
            # No proxy from the environment: the hub is the team's own, named by URL.
            self._session = aiohttp.ClientSession(trust_env=False, headers=self.headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _fail(self, exc: BaseException) -> HubError:
        import http.client

        if isinstance(exc, HubError):
            return exc
        if isinstance(exc, (asyncio.TimeoutError, TimeoutError, socket.timeout)):
            return HubError(self.url, "timeout", f"no answer in {self.timeout:g} s")
        if isinstance(exc, _Invalid):
            return HubError(self.url, "parse", str(exc))
        if isinstance(exc, http.client.HTTPException):
            return HubError(self.url, "parse", "not an HTTP answer a hub gives: "
                            + excerpt(f"{type(exc).__name__}: {exc}", 100))
        aiohttp = sys.modules.get("aiohttp")
        if aiohttp is not None:
            if isinstance(exc, (aiohttp.ClientResponseError, aiohttp.ClientPayloadError)):
                # Not HTTP, or a broken body: what answers there is no hub (or a broken one).
                return HubError(self.url, "parse", "not an HTTP answer a hub gives: "
                                + excerpt(str(getattr(exc, "message", exc)), 100))
            if isinstance(exc, aiohttp.ClientConnectorError):
                return HubError(self.url, "unreachable",
                                excerpt(str(exc.os_error or exc), 120))
            if isinstance(exc, aiohttp.ClientError):
                return HubError(self.url, "unreachable",
                                excerpt(f"{type(exc).__name__}: {exc}", 120))
        if isinstance(exc, OSError):
            return HubError(self.url, "unreachable",
                            excerpt(exc.strerror or f"{type(exc).__name__}: {exc}", 120))
        return HubError(self.url, "error", excerpt(f"{type(exc).__name__}: {exc}", 120))

    def _check_status(self, status: int) -> None:
        if status in (401, 403):
            raise HubError(self.url, "auth", f"refused (HTTP {status}): check [hub] "
                           "token_file")
        if status != 200:
            raise HubError(self.url, "error", f"HTTP {status}")

    async def snapshot(self) -> dict[str, Any]:
        """The hub's document, checked."""
        try:
            body = await asyncio.to_thread(self._get, "api/v1/snapshot")
            return check_document(parse_json(body))
        except Exception as exc:
            raise self._fail(exc) from None

    def _get(self, path: str) -> bytes:
        """One GET (blocking): status checked, the body bounded while it is read, the
        whole exchange within ``timeout``. The socket's own timeout bounds each read
        only: a hub that drips its status line or headers a byte at a time would hold
        ``http.client`` for hours (and the interpreter's exit with it), so a timer
        shuts the socket down when the whole exchange is out of time."""
        import http.client
        import threading
        from urllib.parse import urlsplit

        u = urlsplit(self.url)
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        conn = cls(u.hostname or "", u.port, timeout=self.timeout)
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        timer = threading.Timer(self.timeout, expire)
        timer.daemon = True
        timer.start()
        try:
            conn.request("GET", (u.path or "/") + path, headers=self.headers)
            resp = conn.getresponse()
            self._check_status(resp.status)
            length = resp.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > MAX_DOCUMENT_BYTES:
                raise _Invalid(f"larger than {MAX_DOCUMENT_BYTES} bytes")
            body = bytearray()
            while chunk := resp.read1(1 << 16):
                body += chunk
                if len(body) > MAX_DOCUMENT_BYTES:
                    raise _Invalid(f"larger than {MAX_DOCUMENT_BYTES} bytes")
                if expired.is_set():
                    raise TimeoutError
            if expired.is_set():
                raise TimeoutError
            return bytes(body)
        except Exception:
            if expired.is_set():
                raise TimeoutError from None
            raise
        finally:
            timer.cancel()
            conn.close()

    async def stream(self, last_event_id: str | None = None, *, patches: bool = False
                     ) -> AsyncIterator[tuple[str, str | None, str]]:
        """The hub's events as (event, id, data), until the stream ends or goes quiet for
        ``STREAM_IDLE_S``; then HubError. With ``patches``, changes come as ``patch``
        events (from a hub that has them; an older one sends ``update``)."""
        import aiohttp

        headers = {"Accept": "text/event-stream"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        try:
            timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout,
                                            sock_connect=self.timeout,
                                            sock_read=STREAM_IDLE_S)
            path = "api/v1/events?patches=1" if patches else "api/v1/events"
            async with self._open().get(self.url + path, headers=headers,
                                        timeout=timeout) as resp:
                self._check_status(resp.status)
                async for item in _sse(resp.content):
                    yield item
            raise HubError(self.url, "unreachable", "the event stream ended")
        except GeneratorExit:
            raise
        except Exception as exc:
            raise self._fail(exc) from None


async def _sse(content: Any) -> AsyncIterator[tuple[str, str | None, str]]:
    """Server-Sent Events from a byte stream: lines bounded by MAX_DOCUMENT_BYTES while
    they are read; ``event``, ``id`` and ``data`` fields; comments skipped."""
    buf = bytearray()
    seen = 0  # how much of buf is known to hold no newline (a 1 MB line comes in chunks)
    event, eid, data = "message", None, cast(list[str], [])
    size = 0  # the characters in data (kept as it grows: an event of a million short
    # data lines is then read in one pass, not summed again at each line)
    while True:
        chunk = await content.readany()
        if not chunk:
            return
        buf += chunk
        while True:
            nl = buf.find(b"\n", seen)
            if nl < 0:
                seen = len(buf)
                if len(buf) > MAX_DOCUMENT_BYTES:
                    raise _Invalid(f"an event line longer than {MAX_DOCUMENT_BYTES} bytes")
                break
            line = bytes(buf[:nl]).rstrip(b"\r").decode("utf-8", "replace")
            del buf[: nl + 1]
            seen = 0
            if not line:
                if data:
                    yield event, eid, "\n".join(data)
                event, data, size = "message", [], 0
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)
                size += len(value) + 1
                if size > MAX_DOCUMENT_BYTES:
                    raise _Invalid(f"an event larger than {MAX_DOCUMENT_BYTES} bytes")
            elif name == "id":
                eid = value if len(value) <= 64 else None
