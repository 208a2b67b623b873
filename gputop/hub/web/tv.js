// The wall screen (?tv=1): every GPU as a small tile (load as colour and number, memory,
// holder, a mark for flags), each host one labelled row of tiles, each down host one line.
// The tile size is worked out from the screen and the fleet so the whole fleet fits on one
// page where it can at a size still read across a room; past that the rows are paged.
// Every string is set as text (textContent, title), never parsed as markup.

import {
  anyFree, clock, duration, gpuKey, gpuWords, hostWords, list, matches, num, obj, parseTime,
  shares, str, terms, users, FLAG_WORDS,
} from "./data.js";
import { el } from "./view.js";

// The smallest tile (px) still read from about 3 m on a 1080p wall screen: below it the
// wall pages instead of shrinking further. The largest keeps a small fleet from cartoons.
const MIN_H = 46;
const MIN_W = 44;
const MAX_H = 150;
const MAX_COLS = 6;
const GAP = 4; // between tiles (px)
const ROW_GAP = 6; // between host rows
const COL_GAP = 14; // between columns of hosts
const PER_LINE = 8; // tiles per line a host's width is worked out for (more wrap)

/** Text set as text; an element holding one text node has that node's data changed (no
 * node made or dropped: the cheap path, taken by most numbers of most updates). */
function setText(node, text) {
  if (node.gtText === text) return;
  node.gtText = text;
  const t = node.firstChild;
  if (t !== null && t.nodeType === Node.TEXT_NODE && t.nextSibling === null) {
    t.data = text;
  } else {
    node.textContent = text;
    if (text === "") node.append(document.createTextNode(""));
  }
}

function toggle(node, cls, on) {
  if (node.classList.contains(cls) !== on) node.classList.toggle(cls, on);
}

/** "55G": the memory in use, whole GiB (a tile has room for two or three digits). */
function memShort(used) {
  if (used === null) return "n/a";
  return used >= 1024 ? `${Math.round(used / 1024)}G` : `${Math.round(used)}M`;
}

/** Who holds it: the reservation's holder, else the sharers, else the processes' users. */
function holder(g) {
  const r = obj(g.reservation);
  if (r) return { who: str(r.user, 64) || "?", reserved: true };
  const sh = shares(g).map((s) => str(s.user, 64) || "?");
  if (sh.length) return { who: sh.length > 1 ? `${sh[0]}+${sh.length - 1}` : sh[0], reserved: true };
  const us = users(g);
  return { who: us.length > 1 ? `${us[0]}+${us.length - 1}` : us[0] || "", reserved: false };
}

/** One GPU's tile; ``update`` writes only what changed. */
class Tile {
  constructor() {
    this.el = el("div", "tile");
    this.idx = el("span", "ti");
    this.load = el("span", "tl");
    this.mem = el("span", "tm");
    this.who = el("span", "tw");
    this.bar = el("span", "tb");
    this.el.append(this.idx, this.load, this.mem, this.who, this.bar);
    this.look = "";
    this.frac = -1;
    this.last = null;
    this.free = false;
    this.titleText = "";
    this.pending = null;
  }

  /** On a page not shown: what the filter and the label need now, the rest when shown. */
  defer(g) {
    if (g === this.last) return;
    this.pending = g;
    this.free = anyFree(g);
  }

  flush(host) {
    if (this.pending !== null) this.update(this.pending, host);
  }

  update(g, host) {
    this.pending = null;
    if (g === this.last) return; // (a patch left this GPU as it was)
    this.last = g;
    const index = num(g.index);
    setText(this.idx, index === null ? "?" : String(index));
    const util = num(g.utilization_percent);
    setText(this.load, util === null ? "n/a" : String(Math.round(util)));
    const used = num(g.memory_used_mib), total = num(g.memory_total_mib);
    setText(this.mem, memShort(used));
    const f = used !== null && total ? Math.max(0, Math.min(1, Math.round(used / total * 50) / 50)) : 0;
    if (f !== this.frac) {
      this.frac = f;
      this.bar.style.transform = `scaleX(${f})`;
    }
    const h = holder(g);
    setText(this.who, h.who);
    const flags = list(g.flags).filter((x) => typeof x === "string");
    if (g.lost === true && !flags.includes("lost")) flags.push("lost");
    const free = (this.free = anyFree(g));
    const bucket = util === null ? "un" : util < 10 ? "u0" : util < 40 ? "u1" : util < 70 ? "u2"
      : util < 90 ? "u3" : "u4";
    const bad = flags.includes("unreserved-use") || g.lost === true;
    const wide = util !== null && util >= 100; // (three digits: a smaller number)
    const look = `${bucket}${+free}${+h.reserved}${+(g.lost === true)}${+bad}${+!!flags.length}` +
      `${+wide}`;
    if (look !== this.look) {
      this.look = look;
      // A flag marks the index (its colour: warning, or error for the bad ones).
      this.el.className = `tile ${free ? "free" : bucket}${h.reserved ? " reserved" : ""}` +
        `${g.lost === true ? " lost" : ""}${flags.length ? " flagged" : ""}${bad ? " bad" : ""}` +
        `${wide ? " wide" : ""}`;
    }
    const model = str(g.name, 120) || "unknown GPU";
    const words = flags.map((x) => (Object.hasOwn(FLAG_WORDS, x) ? FLAG_WORDS[x] : str(x, 40)));
    const title = `${host}:${index ?? "?"} ${model}` + (h.who ? ` \u00b7 ${h.who}` : "") +
      (words.length ? ` \u00b7 ${words.join(", ")}` : "");
    if (this.titleText !== title) {
      this.titleText = title;
      this.el.title = title;
    }
  }
}

/** One host: a row (its label, its tiles) while it answers, one line while it is down. */
class WallHost {
  constructor(name) {
    this.name = name;
    this.row = el("section", "tvhost");
    this.row.dataset.host = name;
    const label = el("div", "tvlabel");
    this.title = el("span", "tvname", name);
    this.title.title = name;
    this.info = el("span", "tvinfo");
    label.append(this.title, this.info);
    this.tiles = el("div", "tvtiles");
    this.row.append(label, this.tiles);
    this.line = el("div", "tvdownline");
    this.line.dataset.host = name;
    const dname = el("span", "tvname", name);
    dname.title = name;
    this.kind = el("span", "kind");
    this.msg = el("span", "msg");
    this.lastText = el("span", "last");
    this.line.append(dname, this.kind, this.msg, this.lastText);
    this.byKey = new Map();
    this.down = false;
    this.gpus = 0;
    this.lastOk = null;
    this.shown = true;
    this.off = false; // on a page not shown: its tiles are drawn when it is
  }

  /** Whether the host's place changed (it went down or came back, or its GPUs changed). */
  update(h, ts, freeOnly) {
    const error = obj(h.error);
    const down = h.status !== "ok" || error !== null;
    let moved = down !== this.down;
    this.down = down;
    this.lastOk = parseTime(h.last_ok);
    const words = hostWords(h);
    const hostHit = matches(ts, words);
    const rest = ts.filter((t) => !words.some((w) => w.includes(t)));
    if (down) {
      const kind = error ? str(error.kind, 32) || "error" : str(h.status, 32) || "down";
      setText(this.kind, kind);
      toggle(this.line, "starting", kind === "starting");
      setText(this.msg, error ? str(error.message, 300) : "");
      this.tick(Date.now());
      this.line.title = `${this.name}: ${this.msg.textContent}`;
      moved = this.show(hostHit && !freeOnly) || moved;
      return moved;
    }
    const gpus = list(h.gpus).map(obj).filter(Boolean);
    const seen = new Set();
    const order = [];
    let free = 0;
    gpus.forEach((g, i) => {
      let k = gpuKey(g, i);
      if (seen.has(k)) k = `${k}@${i}`;
      seen.add(k);
      let t = this.byKey.get(k);
      if (!t) {
        t = new Tile();
        this.byKey.set(k, t);
      }
      if (this.off && t.last !== null) t.defer(g);
      else t.update(g, this.name);
      if (t.free) free += 1;
      const on = (!freeOnly || t.free) && (hostHit || !rest.length || matches(rest, gpuWords(g)));
      if (t.el.hidden === on) t.el.hidden = !on;
      order.push(t.el);
    });
    for (const k of [...this.byKey.keys()]) if (!seen.has(k)) this.byKey.delete(k);
    const kids = this.tiles.children;
    if (kids.length !== order.length || order.some((e, i) => kids[i] !== e)) {
      this.tiles.replaceChildren(...order);
      moved = true;
    }
    moved = moved || gpus.length !== this.gpus;
    this.gpus = gpus.length;
    setText(this.info, gpus.length ? `${free} free` : "no GPUs");
    const any = order.some((e) => !e.hidden) || (!freeOnly && hostHit && !gpus.length);
    return this.show(any) || moved;
  }

  flush() {
    for (const t of this.byKey.values()) t.flush(this.name);
  }

  show(on) {
    if (on === this.shown) return false;
    this.shown = on;
    return true;
  }

  tick(now) {
    if (!this.down) return;
    setText(this.lastText, this.lastOk === null ? "never answered"
      : `since ${clock(this.lastOk)} (${duration((now - this.lastOk) / 1000)})`);
  }
}

/** The wall: the down hosts' lines, then the rows; sized to fit, paged past that. */
export class Wall {
  constructor(board, pageText) {
    this.box = board; // the board's area (its height is the page's)
    this.pageText = pageText;
    this.el = el("div", "wall");
    this.downs = el("div", "tvdowns");
    this.flow = el("div", "tvflow");
    this.el.append(this.downs, this.flow);
    board.append(this.el);
    this.hosts = new Map();
    this.order = [];
    this.page = 0;
    this.starts = [0];
    this.size = "";
  }

  /** Take the hosts named (``all``: the whole order, after a snapshot or a removal). */
  update(names, hostsByName, order, q, freeOnly, all) {
    const ts = terms(q);
    let moved = all;
    for (const n of names) {
      const h = hostsByName.get(n);
      if (!h) continue;
      let w = this.hosts.get(n);
      if (!w) {
        w = new WallHost(n);
        this.hosts.set(n, w);
        moved = true;
      }
      if (w.update(h, ts, freeOnly)) moved = true;
    }
    if (all) {
      const keep = new Set(order);
      for (const n of [...this.hosts.keys()]) if (!keep.has(n)) this.hosts.delete(n);
    }
    if (!moved) return;
    this.order = order.filter((n) => this.hosts.has(n));
    const ws = this.order.map((n) => this.hosts.get(n)).filter((w) => w.shown);
    const downs = ws.filter((w) => w.down).map((w) => w.line);
    const rows = ws.filter((w) => !w.down).map((w) => w.row);
    replace(this.downs, downs);
    replace(this.flow, rows);
    this.downs.hidden = !downs.length;
    this.layout();
  }

  tick(now) {
    for (const w of this.hosts.values()) w.tick(now);
  }

  /** Size the tiles so every row fits the board's area, or page at the smallest size. */
  layout() {
    this.setPaging(false);
    const W = this.box.clientWidth;
    const rows = [...this.flow.children];
    const widest = Math.min(PER_LINE, Math.max(1, ...rows.map((r) =>
      [...r.lastChild.children].filter((t) => !t.hidden).length)));
    // Labels as wide as nine names in ten need: one long (or hostile) name is cut, it
    // does not shrink every tile.
    const lens = rows.map((r) => r.dataset.host.length).sort((a, b) => a - b);
    const chars = Math.min(24, Math.max(4, lens[Math.floor((lens.length - 1) * 0.9)] ?? 4));
    const fit = (H) => best(W, H, rows.length, widest, chars);
    let s = fit(this.box.clientHeight - this.downHeight());
    let paged = s.th < MIN_H || s.tw < MIN_W;
    if (paged) {
      this.setPaging(true);
      s = fit(0);
    }
    this.apply(s);
    // The sums above assume one line of tiles per host; a host wider than that (or a
    // font wider than thought) shows in the measured height: shrink until it fits.
    for (let i = 0; !paged && i < 12 && this.el.scrollHeight > this.box.clientHeight + 1; i++) {
      s = { ...s, th: Math.floor(s.th * 0.93), tw: Math.floor(s.tw * 0.97) };
      if (s.th < MIN_H || s.tw < MIN_W) {
        paged = true;
        this.setPaging(true);
        s = fit(0);
      }
      this.apply(s);
    }
    this.turn(0);
  }

  downHeight() {
    return this.downs.hidden ? 0 : this.downs.offsetHeight + ROW_GAP;
  }

  setPaging(on) {
    this.pageText.parentElement.hidden = !on;
  }

  apply(s) {
    const key = `${s.cols}/${s.tw}/${s.th}/${s.lw}`;
    if (key === this.size) return;
    this.size = key;
    const st = this.el.style;
    st.setProperty("--cols", String(s.cols));
    st.setProperty("--tw", `${s.tw}px`);
    st.setProperty("--th", `${s.th}px`);
    st.setProperty("--lw", `${s.lw}px`);
    // The tile's type: as large as its height allows, and its width (a name, "100").
    st.setProperty("--fs", `${Math.max(10, Math.min(36, s.th * 0.27, s.tw * 0.25)).toFixed(1)}px`);
    this.el.classList.toggle("roomy", s.tw >= 1.4 * s.th);
  }

  /** Show page ``page + step`` (of the rows as laid out now); the indicator says which. */
  turn(step) {
    const height = this.box.clientHeight;
    const items = [...this.downs.children, ...this.flow.children].map((e) =>
      ({ e, top: e.offsetTop, bottom: e.offsetTop + e.offsetHeight }));
    items.sort((a, b) => a.top - b.top);
    const starts = [0];
    for (;;) {
      const start = starts[starts.length - 1];
      const next = items.find((it) => it.top > start && it.bottom > start + height);
      if (!next || starts.length > 200) break;
      starts.push(next.top);
    }
    this.starts = starts;
    this.page = (this.page + step) % starts.length;
    const top = starts[this.page];
    this.box.scrollTop = top;
    for (const it of items) {
      const off = it.top < top || it.bottom > top + height + 1;
      toggle(it.e, "offpage", off);
      const w = this.hosts.get(it.e.dataset.host);
      if (w && w.off !== off) {
        w.off = off;
        if (!off) w.flush(); // (drawn before its page shows, not after)
      }
    }
    setText(this.pageText, starts.length > 1 ? `page ${this.page + 1} of ${starts.length}` : "");
    this.setPaging(starts.length > 1);
  }
}

function replace(box, want) {
  const kids = box.children;
  if (kids.length !== want.length || want.some((e, i) => kids[i] !== e)) box.replaceChildren(...want);
}

/** The largest tiles for ``n`` rows of up to ``per`` tiles in W x H (H 0: the smallest
 * height, for paging), over 1 to MAX_COLS columns of hosts; the labels as wide as names
 * of ``chars`` characters need (a longer name is cut, never widens the row). */
function best(W, H, n, per, chars) {
  let out = null;
  for (let cols = 1; cols <= MAX_COLS; cols++) {
    const colW = (W - (cols - 1) * COL_GAP) / cols;
    const lines = Math.max(1, Math.ceil(n / cols));
    let th = H > 0 ? Math.floor(H / lines - ROW_GAP) : MIN_H;
    th = Math.min(th, MAX_H);
    const font = Math.min(30, Math.max(13, th * 0.3)); // .tvlabel .tvname's size
    const lw = Math.round(Math.min(colW * 0.3, chars * 0.75 * font + 24));
    let tw = Math.floor((colW - lw - GAP * per) / per);
    th = Math.min(th, Math.round(tw * 1.25));
    tw = Math.min(tw, Math.round(th * 2.6));
    const s = { cols, tw, th, lw, score: Math.min(tw, th) };
    if (H === 0) {
      if (tw >= MIN_W && th >= MIN_H) out = s; // paged: the most hosts a page holds
    } else if (out === null || s.score > out.score) {
      out = s;
    }
  }
  // (A screen too narrow for a host's tiles on one line: the tiles wrap, each row taller.)
  return out ?? { cols: 1, tw: MIN_W, th: MIN_H, lw: Math.min(100, W * 0.3), score: MIN_H };
}
