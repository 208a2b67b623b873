// The web board: the hub's event stream (a snapshot, then updates of the hosts that
// changed) kept as one document, drawn by view.js, filtered and sorted as the terminal
// board is, with the view in the URL. While the stream is down the page says so, greys
// the data and never calls it current; a restarted hub's snapshot replaces everything.

import {
  clock, compareRows, duration, hostName, list, obj, parseTime, patched, readState, str,
  summaryText, terms, writeState,
} from "./data.js";
import { renderPeople, renderQueue, renderWaste } from "./panels.js";
import { Wall } from "./tv.js";
import { HostView } from "./view.js";

const $ = (id) => document.getElementById(id);
const WATCHDOG_S = 30; // no event for this long: ask /-/healthy whether the hub still lives
const WASTE_EVERY_S = 300;
// Patches that do not fit: the first RESYNC_FREE of a run start the stream again at once;
// after that the page waits 2, 4, 8 ... RESYNC_MAX_S seconds first (a hub whose every patch
// misfits costs it a snapshot at most that often, not one per patch). A run ends only when
// RESYNC_QUIET_S pass with no misfit, so a hub that keeps misfitting stays at the longest.
const RESYNC_FREE = 2;
const RESYNC_QUIET_S = 120;
const RESYNC_MAX_S = 30;

const state = readState(location.search);
// A hub's token (docs/web.md) is held here only: never in a cookie or the browser's
// storage (a browser sends a host's cookies to every port of it, where another service
// could take them). It comes from the address (#token=..., removed from the address bar
// at once) or from the form; a reload needs it again.
let token = takeToken();
const board = {
  hosts: new Map(), // name -> the host object, as the hub sent it
  order: [],
  views: new Map(), // name -> HostView
  queue: null,
  reservations: null, // every active reservation (the document's top-level list)
  summary: null, // the fleet's count, as the hub made it (the document's summary)
  resError: null,
  conn: "connecting",
  since: null, // when the current connection state began (ms)
  lastEvent: 0, // when the last event came (shown as "updated")
  lastHeard: 0, // ... or the hub last answered /-/healthy (the watchdog's clock)
  snapshots: 0,
  updates: 0, // updates and patches taken
  resyncs: 0, // patches that did not fit: the stream started again
  resyncRun: 0, // misfits since the last RESYNC_QUIET_S without one
  lastResync: 0, // when the last one was (ms)
  awaitingSnapshot: false, // started again for a snapshot that has not come yet
  resyncWait: 0, // ms the page waits before the last start again (0: at once)
  epoch: null,
  flatKey: "",
};
window.gputopBoard = board; // what the browser tests read: counters and the state

const panes = {};
for (const id of ["queue", "people", "waste"]) {
  const sec = $(id);
  panes[id] = { el: sec, count: sec.querySelector(".count") || sec, list: sec.querySelector(".list") };
}

// --- the stream --------------------------------------------------------------------------

let source = null;
let liveTimer = null;
let resyncTimer = null;
let connects = 0; // each start of the stream: a ticket that comes late is for an old one

function takeToken() {
  const m = /^#(?:.*&)?token=([^&]*)/.exec(location.hash);
  if (!m) return "";
  history.replaceState(null, "", location.pathname + location.search);
  try {
    return decodeURIComponent(m[1]).trim();
  } catch {
    return "";
  }
}

/** ``init`` for fetch, with the token in the header when the page holds one. */
function authed(init = {}) {
  return token ? { ...init, headers: { Authorization: `Bearer ${token}` } } : init;
}

function setConn(conn) {
  if (board.conn === conn) return;
  board.conn = conn;
  board.since = Date.now();
  drawConn();
}

function drawConn() {
  const pill = $("conn");
  const stale = board.conn !== "live";
  pill.className = `conn ${board.conn}`;
  pill.textContent = board.conn === "live" ? "live" : board.snapshots ? "stale" : "connecting";
  document.body.classList.toggle("stale", stale && board.snapshots > 0);
  document.title = stale && board.snapshots ? "gputop (stale)" : "gputop";
  const banner = $("banner");
  banner.hidden = !stale || !board.snapshots;
  if (!banner.hidden) {
    banner.textContent = `Not connected to the hub since ${clock(board.since)} ` +
      `(${duration((Date.now() - board.since) / 1000)}): what you see is as it was then ` +
      "and may be out of date. Reconnecting\u2026";
  }
}

function connect() {
  clearTimeout(liveTimer);
  clearTimeout(resyncTimer);
  if (source) source.close();
  // A new stream (a resync, the watchdog, a refusal's retry) starts with its snapshot:
  // nothing is current until it comes (the browser's own reconnects of one stream resume
  // it instead, and are current once open: the 1.5 s moment below).
  board.awaitingSnapshot = true;
  source = null;
  const attempt = ++connects;
  if (!token) {
    stream("");
    return;
  }
  // An EventSource sends no header: the token buys a ticket, good for one stream and a
  // few seconds (the browser's own reconnect of that stream is refused: see onerror).
  fetch("/api/v1/ticket", authed({ method: "POST", cache: "no-store" }))
    .then(async (r) => {
      if (attempt !== connects) return;
      if (r.status === 401) {
        $("tokenform").hidden = false;
        return;
      }
      const ticket = r.ok ? str(obj(await r.json())?.ticket) : "";
      if (attempt !== connects) return;
      if (!ticket) throw new Error(`ticket: ${r.status}`);
      stream(`&ticket=${encodeURIComponent(ticket)}`);
    })
    .catch(() => {
      if (attempt === connects) resyncTimer = setTimeout(connect, 5000);
    });
}

function stream(ticket) {
  // Patches (docs/hub.md): a host whose GPUs only moved comes as what moved, about a
  // fifth of its complete object, and its unchanged GPUs keep their objects.
  const es = (source = new EventSource(`/api/v1/events?patches=1${ticket}`));
  es.onopen = () => {
    // A restarted hub's snapshot (or a resumed stream's missed updates) comes at once;
    // a resumed stream that missed nothing sends nothing: current, then, after a moment.
    clearTimeout(liveTimer);
    liveTimer = setTimeout(() => {
      if (source === es && es.readyState === EventSource.OPEN && board.snapshots &&
          !board.awaitingSnapshot) setConn("live");
    }, 1500);
  };
  es.addEventListener("snapshot", (e) => measured("gputop-snapshot", () => {
    const doc = parse(e.data);
    if (doc === null) {
      // Nothing to start from: start again (with the backoff), never go on from the
      // document held before (the patches that follow are worked out against this one).
      resync();
      return;
    }
    board.epoch = String(e.lastEventId).split("-")[0];
    board.awaitingSnapshot = false;
    applySnapshot(doc);
    heard();
  }));
  es.addEventListener("update", (e) => measured("gputop-update", () => {
    const up = parse(e.data);
    if (up === null || !board.snapshots || board.awaitingSnapshot) return;
    applyUpdate(up);
    heard();
  }));
  es.addEventListener("patch", (e) => measured("gputop-update", () => {
    const up = parse(e.data);
    // (Before this stream's snapshot nothing is current, whatever fits: see resync.)
    if (up === null || !board.snapshots || board.awaitingSnapshot) return;
    if (!applyPatch(up)) {
      // A patch that does not fit what this page holds: start again from a snapshot,
      // saying meanwhile that what is shown is not current.
      resync();
      return;
    }
    heard();
  }));
  es.onerror = () => {
    setConn("stale");
    if (es.readyState === EventSource.CLOSED || ticket) {
      // A refusal (503: too many streams, 401) ends an EventSource for good: start anew,
      // unless the hub wants a token this page does not have yet. (A ticket is spent:
      // the browser's own reconnect would be refused, so the page starts anew at once.)
      es.close();
      refused(es);
    }
  };
}

function resync() {
  board.resyncs += 1;
  const now = Date.now();
  if (now - board.lastResync >= RESYNC_QUIET_S * 1000) board.resyncRun = 0;
  board.lastResync = now;
  board.resyncRun += 1;
  const over = board.resyncRun - RESYNC_FREE;
  board.resyncWait = over > 0 ? Math.min(RESYNC_MAX_S, 2 ** over) * 1000 : 0;
  // What is shown is not current until the new stream's snapshot: an open stream alone
  // (the 1.5 s timer in connect) does not make the page live again.
  board.awaitingSnapshot = true;
  setConn("stale");
  if (!board.resyncWait) {
    connect();
    return;
  }
  clearTimeout(liveTimer);
  if (source) source.close();
  source = null;
  resyncTimer = setTimeout(connect, board.resyncWait);
}

async function refused(es) {
  let status = 0;
  try {
    status = (await fetch("/-/healthy", { cache: "no-store" })).ok
      ? (await fetch("/api/v1/snapshot", authed({ cache: "no-store", method: "HEAD" })))
        .status : 0;
  } catch {
    status = 0;
  }
  if (source !== es) return;
  if (status === 401) {
    $("tokenform").hidden = false;
    return;
  }
  setTimeout(() => { if (source === es) connect(); }, token ? 2000 : 5000);
}

function useToken(e) {
  e.preventDefault();
  const typed = $("token").value.trim();
  if (!typed) return;
  token = typed;
  $("token").value = "";
  $("tokenform").hidden = true;
  connect();
  loadWaste();
}

function heard() {
  board.lastEvent = board.lastHeard = Date.now();
  clearTimeout(liveTimer);
  setConn("live");
}

function parse(text) {
  try {
    return obj(JSON.parse(text));
  } catch {
    return null;
  }
}

let measures = 0;

/** ``fn`` timed with the performance API (what the browser tests read); the timeline is
 * cleared now and then, so a page left open for days does not keep every entry. */
function measured(name, fn) {
  const t0 = performance.now();
  fn();
  performance.measure(name, { start: t0 });
  if (++measures >= 5000) {
    measures = 0;
    performance.clearMeasures();
  }
}

/** A quiet fleet sends no events and keepalives are invisible to EventSource: after
 * ``WATCHDOG_S`` without one, a hub that does not answer /-/healthy is a lost stream. */
async function watchdog() {
  if (board.conn !== "live" || Date.now() - board.lastHeard < WATCHDOG_S * 1000) return;
  const es = source;
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), 5000);
  try {
    const r = await fetch("/-/healthy", { cache: "no-store", signal: ctl.signal });
    if (r.ok) {
      board.lastHeard = Date.now();
      return;
    }
  } catch {
    // down or hung: below
  } finally {
    clearTimeout(timer);
  }
  // Meanwhile the stream may have been started again, or be waiting out a resync's
  // backoff: that one stands (starting here would skip the wait).
  if (source !== es || board.conn !== "live") return;
  setConn("stale");
  connect();
}

// --- the document ------------------------------------------------------------------------

function applySnapshot(doc) {
  board.snapshots += 1;
  const hosts = list(doc.hosts).map(obj).filter((h) => h && hostName(h));
  const names = new Set();
  board.hosts = new Map();
  for (const h of hosts) {
    const n = hostName(h);
    if (names.has(n)) continue;
    names.add(n);
    board.hosts.set(n, h);
  }
  board.order = [...names];
  for (const [n, v] of board.views) {
    if (!names.has(n)) {
      v.drop();
      board.views.delete(n);
    }
  }
  board.queue = doc.queue ?? null;
  board.reservations = doc.reservations ?? null;
  board.summary = doc.summary ?? null;
  board.resError = typeof doc.reservations_error === "string" ? doc.reservations_error : null;
  $("loading").hidden = true;
  refresh(board.order, true);
}

/** An ``update``: each host complete. */
function applyUpdate(up) {
  board.updates += 1;
  refresh(takeHosts(up), takeRest(up));
}

/** A ``patch``: hosts complete (as in an update) and changes to the others, applied
 * whole or not at all; false (nothing applied) when a change does not fit. */
function applyPatch(up) {
  // The hosts as they are once the patch's complete ones are in (most patches have none).
  const incoming = new Map();
  for (const h of list(up.hosts).map(obj)) if (h && hostName(h)) incoming.set(hostName(h), h);
  const changes = patched({ get: (n) => incoming.get(n) ?? board.hosts.get(n) }, up.changes);
  if (changes === null) return false;
  board.updates += 1;
  const changed = takeHosts(up);
  const named = new Set(changed);
  for (const [n, h] of changes) {
    board.hosts.set(n, h);
    if (!named.has(n)) changed.push(n);
  }
  refresh(changed, takeRest(up));
  return true;
}

/** The complete hosts of an update or patch, into the board; their names. */
function takeHosts(up) {
  const changed = [];
  for (const h of list(up.hosts).map(obj)) {
    const n = h && hostName(h);
    if (!n) continue;
    if (!board.hosts.has(n)) board.order.push(n);
    board.hosts.set(n, h);
    changed.push(n);
  }
  return changed;
}

/** ``removed`` and ``set`` of an update or patch; whether hosts went (a new order). */
function takeRest(up) {
  let reorder = false;
  for (const x of list(up.removed)) {
    const n = hostName({ name: x }); // (the name the page keeps it under: cut, as a host's)
    if (!n || !board.hosts.has(n)) continue;
    board.hosts.delete(n);
    board.order = board.order.filter((x) => x !== n);
    board.views.get(n)?.drop();
    board.views.delete(n);
    reorder = true;
  }
  const set = obj(up.set) || {};
  if ("queue" in set) board.queue = set.queue;
  if ("reservations" in set) board.reservations = set.reservations;
  if ("summary" in set) board.summary = set.summary;
  if ("reservations_error" in set) {
    board.resError = typeof set.reservations_error === "string" ? set.reservations_error : null;
  }
  return reorder;
}

// --- drawing -----------------------------------------------------------------------------

/** Update the views of ``names``; place them; filter; redraw the summary and panels. */
function refresh(names, all) {
  if (wall !== null) {
    wall.update(names, board.hosts, board.order, state.q, state.free, all);
    drawSummary();
    drawPanels();
    drawConn();
    return;
  }
  const hostsBox = $("hosts");
  let placed = all;
  for (const n of names) {
    if (!board.hosts.has(n)) continue; // (named and removed in one event)
    let v = board.views.get(n);
    if (!v) {
      v = new HostView(n);
      board.views.set(n, v);
      placed = true;
    }
    if (v.update(board.hosts.get(n))) placed = true;
  }
  if (placed) {
    const want = board.order.map((n) => board.views.get(n).el);
    if (want.some((e, i) => hostsBox.children[i] !== e) || hostsBox.children.length !== want.length) {
      hostsBox.replaceChildren(...want);
    }
  }
  applyView(all ? board.order : names, placed);
}

function applyView(names, placed) {
  const ts = terms(state.q);
  const flat = state.sort !== "host";
  document.body.classList.toggle("flatview", flat);
  $("flat").hidden = !flat;
  let any = false;
  for (const n of names) {
    const v = board.views.get(n);
    const on = v.filter(ts, state.free);
    const hide = !on || (flat && !v.failed);
    if (v.el.gtShown !== !hide) {
      v.el.gtShown = !hide;
      v.el.hidden = hide;
    }
    if (!flat && placed) v.adopt();
  }
  for (const v of board.views.values()) any = any || !v.el.hidden;
  if (flat) any = placeFlat() || any;
  $("nomatch").hidden = any || !board.snapshots;
  drawSummary();
  drawPanels();
  drawConn();
}

/** The sorted views: every kept row in one list, in sort order. The list is a flex column
 * and each row's place is its CSS ``order``: a new order writes the places that changed,
 * and no row is moved in the document (moving 1,600 rows costs 40 ms; this, a few). */
function placeFlat() {
  const rows = [];
  for (const n of board.order) {
    for (const r of board.views.get(n).gpuRows()) {
      if (r.shown) rows.push({ host: n, index: r.index, util: r.util_, freeMib: r.freeMib, r });
    }
  }
  rows.sort(compareRows(state.sort));
  // Rows by their own ids: a host and index may name two rows (GPUs without an index) or
  // a row made again (a new uuid), which must still be placed.
  const key = rows.map((x) => x.r.id).join(",");
  if (key !== board.flatKey) {
    board.flatKey = key;
    const box = $("flat");
    const add = [];
    rows.forEach((x, i) => {
      if (x.r.el.parentNode !== box) add.push(x.r.el);
      if (x.r.place !== i) {
        x.r.place = i;
        x.r.el.style.order = String(i);
      }
    });
    if (add.length) box.append(...add);
  }
  return rows.length > 0;
}

function drawSummary() {
  const hosts = board.order.map((n) => board.hosts.get(n));
  $("summary").textContent = summaryText(board.summary, hosts);
  $("asof").textContent = board.lastEvent ? `updated ${clock(board.lastEvent)}` : "";
  const rp = $("resproblem");
  rp.hidden = board.resError === null;
  if (board.resError !== null) rp.textContent = `reservations file: ${str(board.resError, 400)}`;
}

let panelsAt = 0;
let panelsTimer = null;

/** The panels at most once a second: an update of one host need not rebuild them each time. */
function drawPanels() {
  const wait = 1000 - (Date.now() - panelsAt);
  if (wait > 0) {
    if (!panelsTimer) panelsTimer = setTimeout(() => { panelsTimer = null; drawPanels(); }, wait);
    return;
  }
  panelsAt = Date.now();
  const now = Date.now();
  renderQueue(panes.queue, board.queue, now);
  renderPeople(panes.people, board.order.map((n) => board.hosts.get(n)), now,
    board.reservations);
}

async function loadWaste() {
  try {
    const r = await fetch("/api/v1/waste", authed({ cache: "no-store" }));
    renderWaste(panes.waste, r.ok ? await r.json() : null);
  } catch {
    // the hub is away: the stream says so; the panel keeps what it had
  }
}

// --- controls and the URL ----------------------------------------------------------------

function pushState() {
  history.replaceState(null, "", location.pathname + writeState(state));
}

function controls() {
  const filter = $("filter"), free = $("freeonly"), sort = $("sort");
  filter.value = state.q;
  free.checked = state.free;
  sort.value = state.sort;
  let timer = null;
  filter.addEventListener("input", () => {
    clearTimeout(timer);
    timer = setTimeout(() => {
      state.q = filter.value.slice(0, 200);
      pushState();
      applyView(board.order, true);
    }, 120);
  });
  free.addEventListener("change", () => {
    state.free = free.checked;
    pushState();
    applyView(board.order, true);
  });
  sort.addEventListener("change", () => {
    state.sort = sort.value;
    board.flatKey = "";
    pushState();
    applyView(board.order, true);
  });
  $("controls").addEventListener("submit", (e) => e.preventDefault());
  $("tokenform").addEventListener("submit", useToken);
}

// --- wall-screen mode: every GPU a tile, sized to fit; paged only past that -----------------

const wall = state.tv ? new Wall($("board"), $("tvpage")) : null;

// --- start -------------------------------------------------------------------------------

controls();
if (state.tv) {
  document.documentElement.classList.add("tv");
  document.body.classList.add("tv");
  setInterval(() => wall.turn(1), state.every * 1000);
  let resized = null;
  addEventListener("resize", () => {
    clearTimeout(resized);
    resized = setTimeout(() => wall.layout(), 200);
  });
}
setInterval(() => {
  const now = Date.now();
  for (const v of board.views.values()) v.tick(now);
  wall?.tick(now);
  drawConn();
  watchdog();
}, 5000);
setInterval(loadWaste, WASTE_EVERY_S * 1000);
loadWaste();
connect();
export { board, parseTime };
