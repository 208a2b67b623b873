// The web board's DOM: one HostView per host, one GpuView per GPU, each updated in place
// (only what changed is written), so an update of many hosts stays cheap. Every string from
// the hub is set with textContent or as an attribute value: never parsed as markup.

import {
  anyFree, clock, duration, freeMib, gib, gpuKey, gpuWords, hostName, hostWords, instanceFree,
  FLAG_WORDS, list, matches, num, obj, parseTime, processes, shares, str,
} from "./data.js";

/** An element with a class and, optionally, text (as text). */
export function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null && text !== "") e.textContent = text;
  return e;
}

/** Text set as text. The last text set is kept on the node (``gtText``), so an unchanged
 * value costs no DOM read; an element holding one text node has that node's data changed
 * (no node made or dropped: the cheap path, taken by every number of every update). */
function setText(node, text) {
  if (node.gtText === text) return;
  node.gtText = text;
  const t = node.firstChild;
  if (t !== null && t.nodeType === Node.TEXT_NODE && t.nextSibling === null) {
    if (t.data !== text) t.data = text;
  } else if (node.textContent !== text) {
    node.textContent = text;
    if (text === "") node.append(document.createTextNode(""));
  }
}

function setTitle(node, text) {
  if (node.title !== text) node.title = text;
}

/** Shown or hidden; the state last set is kept on the node, as with setText. */
function show(node, on) {
  if (node.gtShown === on) return;
  node.gtShown = on;
  if (node.hidden === on) node.hidden = !on;
}

/** Which rows are on screen (or within a screen's margin of it). */
const views = new WeakMap();
const sight = new IntersectionObserver((entries) => {
  const t0 = performance.now();
  for (const e of entries) {
    const v = views.get(e.target);
    if (!v) continue;
    v.seen = e.isIntersecting;
    if (v.seen) v.flush();
  }
  performance.measure("gputop-draw", { start: t0 });
}, { rootMargin: "50% 0px" });

/** A bar: a fill scaled to a fraction (a transform: no layout) and its value as text. */
class Bar {
  constructor(cls) {
    this.el = el("div", `bar ${cls}`);
    this.fill = el("div", "fill");
    this.val = el("span", "val");
    this.el.append(this.fill, this.val);
    this.frac = -1;
    this.na = false;
  }

  set(frac, text) {
    const f = frac === null ? 0 : Math.max(0, Math.min(1, Math.round(frac * 500) / 500));
    if (f !== this.frac) {
      this.fill.style.transform = `scaleX(${f})`;
      this.frac = f;
    }
    if ((frac === null) !== this.na) {
      this.na = frac === null;
      this.el.classList.toggle("na", this.na);
    }
    setText(this.val, text);
  }
}

function memText(used, total) {
  if (used === null) return "n/a";
  if (total === null) return gib(used);
  const u = gib(used), t = gib(total);
  return u.endsWith(" GiB") && t.endsWith(" GiB") ? `${u.slice(0, -4)}/${t}` : `${u} / ${t}`;
}

/** The model without the vendor's name in front: the row is narrow, the title has it all. */
function model(name) {
  return name.replace(/^NVIDIA\s+/, "") || name;
}

function procList(procs) {
  const ul = el("ul", "procs");
  for (const p of procs.slice(0, 12)) {
    const li = el("li", "proc");
    const cmd = str(p.command) || "?";
    li.append(el("span", "user", str(p.user, 64) || "?"), el("span", "cmd", cmd),
      el("span", "pmem", gib(p.gpu_memory_mib)));
    li.title = `${str(p.user, 64) || "?"} (pid ${num(p.pid) ?? "?"}): ${cmd}`;
    ul.append(li);
  }
  if (procs.length > 12) ul.append(el("li", "more", `+${procs.length - 12} more`));
  return ul;
}

/** "reserved by X · 2h 10m left · note": the time left is kept up to date by tick(). */
class Reservation {
  constructor() {
    this.el = el("div", "res");
    this.who = el("span", "who");
    this.left = el("span", "left");
    this.note = el("span", "note");
    this.el.append(el("span", "label", "reserved by "), this.who, this.left, this.note);
    this.expires = null;
    this.expiresText = null;
    this.el.hidden = true;
  }

  set(r) {
    show(this.el, r !== null);
    if (r === null) {
      this.expires = this.expiresText = null; // (one back with the same expiry counts again)
      return;
    }
    setText(this.who, str(r.user, 64) || "?");
    setText(this.note, str(r.note, 200));
    if (r.expires !== this.expiresText) {
      this.expiresText = r.expires;
      this.expires = parseTime(r.expires);
      if (this.expires === null) setText(this.left, ""); // (not the last one's time left)
    }
    this.tick(Date.now());
  }

  tick(now) {
    if (this.expires === null) return;
    const s = (this.expires - now) / 1000;
    setText(this.left, s > 0 ? `${duration(s)} left` : "expired");
  }
}

class InstanceView {
  constructor(parent) {
    this.el = el("div", "inst");
    this.prof = el("span", "prof");
    this.mem = new Bar("mem");
    this.res = new Reservation();
    this.procs = el("div", "iprocs");
    this.el.append(this.prof, this.mem.el, this.res.el, this.procs);
    parent.append(this.el);
    this.procKey = "";
  }

  /** ``whole``: the GPU's own reservation, which covers every instance (shown once, on
   * the GPU's line, not again on each instance). */
  update(inst, gpuLabel, whole) {
    const gi = num(inst.gpu_instance_id);
    setText(this.prof, `${str(inst.profile, 32) || "MIG"} (GI ${gi ?? "?"})`);
    const used = num(inst.memory_used_mib), total = num(inst.memory_total_mib);
    this.mem.set(used !== null && total ? used / total : null, memText(used, total));
    const r = obj(inst.reservation);
    this.res.set(r !== null && (whole === null || r.id !== whole.id) ? r : null);
    const procs = processes(inst.processes);
    const key = JSON.stringify(procs);
    if (key !== this.procKey) {
      this.procKey = key;
      this.procs.replaceChildren(procs.length ? procList(procs) : el("span", "hint",
        instanceFree(inst) ? `free \u00b7 gputop reserve ${gpuLabel}/${gi ?? "?"}` : ""));
    }
    this.el.classList.toggle("free", instanceFree(inst));
  }
}

let rowIds = 0;

/** One GPU's row. ``update`` writes only the cells whose value changed. */
export class GpuView {
  constructor(host) {
    this.host = host;
    this.el = el("div", "gpu");
    this.idx = el("span", "idx");
    this.hostCell = el("span", "hostcell", host);
    this.name = el("span", "name");
    this.util = new Bar("util");
    this.mem = new Bar("mem");
    this.temp = el("span", "temp");
    this.power = el("span", "power");
    this.detail = el("div", "detail");
    this.procs = el("div", "procwrap");
    this.res = new Reservation();
    this.flags = el("span", "flags");
    this.hint = el("span", "hint");
    this.mig = el("div", "mig");
    this.mig.hidden = true;
    this.detail.append(this.procs, this.res.el, this.flags, this.hint);
    this.el.append(this.idx, this.hostCell, this.name, this.util.el, this.mem.el, this.temp,
      this.power, this.detail, this.mig);
    this.insts = [];
    this.key = { procs: null, flags: null, mig: null };
    this.free = false;
    this.wordsOf = null; // the GPU whose words the filter has not yet worked out
    this.words_ = [];
    this.util_ = null;
    this.freeMib = -1;
    this.index = 0;
    this.look = "";
    this.id = ++rowIds; // (the sorted views' key: host and index may name two rows)
    this.place = -1; // its CSS order in the sorted views
    this.seen = false;
    this.drawn = false;
    this.pending = null;
    this.last = null; // the GPU object last taken
    views.set(this.el, this);
    sight.observe(this.el);
  }

  drop() {
    sight.unobserve(this.el);
    views.delete(this.el);
    this.el.remove();
  }

  /** What the filter and the sort need, at once; the row itself now if it is on screen
   * (or new), else when it comes into view: an update of 200 hosts writes only the rows
   * someone can see. */
  update(g) {
    if (g === this.last) return; // (a patch left this GPU as it was)
    this.last = g;
    const index = num(g.index);
    this.index = index ?? 1e9;
    this.util_ = num(g.utilization_percent);
    this.freeMib = freeMib(g);
    this.free = anyFree(g);
    this.wordsOf = g; // (worked out when a filter asks: most updates have none)
    if (this.seen || !this.drawn) {
      this.draw(g);
    } else {
      this.pending = g;
    }
  }

  /** What the filter matches a term against: worked out for the GPU last taken. */
  get words() {
    if (this.wordsOf !== null) {
      this.words_ = gpuWords(this.wordsOf);
      this.wordsOf = null;
    }
    return this.words_;
  }

  /** Draw what is waiting (the row came into view, or a page of the wall screen did). */
  flush() {
    if (this.pending !== null) this.draw(this.pending);
  }

  draw(g) {
    this.pending = null;
    this.drawn = true;
    const index = num(g.index);
    setText(this.idx, index === null ? "?" : String(index));
    setText(this.name, model(str(g.name, 120)) || "unknown GPU");
    setTitle(this.name, str(g.name, 300));
    const util = num(g.utilization_percent);
    this.util.set(util === null ? null : util / 100, util === null ? "n/a" : `${util}%`);
    const used = num(g.memory_used_mib), total = num(g.memory_total_mib);
    this.mem.set(used !== null && total ? used / total : null, memText(used, total));
    const t = num(g.temperature_c);
    setText(this.temp, t === null ? "n/a" : `${t}\u00b0C`);
    const p = num(g.power_draw_w), pl = num(g.power_limit_w);
    setText(this.power, p === null ? "n/a" : `${Math.round(p)} W`);
    setTitle(this.power, pl === null ? "" : `limit ${Math.round(pl)} W`);
    const insts = list(g.instances).map(obj).filter(Boolean);
    // On a MIG GPU a process is listed under its instance; here only those without one.
    const procs = processes(g.processes).filter((p) => !insts.length ||
      num(p.gpu_instance_id) === null);
    const pk = JSON.stringify(procs);
    if (pk !== this.key.procs) {
      this.key.procs = pk;
      this.procs.replaceChildren(...(procs.length ? [procList(procs)] : []));
    }
    const r = obj(g.reservation);
    this.res.set(r);
    const flags = list(g.flags).filter((f) => typeof f === "string");
    if (g.lost === true && !flags.includes("lost")) flags.push("lost");
    const fk = flags.join(",") + (g.lost === true ? `|${str(g.lost_reason)}` : "");
    if (fk !== this.key.flags) {
      this.key.flags = fk;
      this.flags.replaceChildren(...flags.map((f) => {
        const known = Object.hasOwn(FLAG_WORDS, f); // ("constructor" is a flag's name too)
        const chip = el("span", `flag ${known ? f : "other"}`, known ? FLAG_WORDS[f] : str(f, 40));
        if (f === "lost") chip.title = str(g.lost_reason);
        return chip;
      }));
    }
    const sh = shares(g);
    setText(this.hint, this.free && !insts.length
      ? `free \u00b7 gputop reserve ${this.host}:${index ?? "?"}`
      : sh.length ? `shared: ${sh.map((s) => `${str(s.user, 64) || "?"} ${gib(s.share_mib)}`)
        .join(", ")} \u00b7 ${gib(g.unshared_mib)} left unshared` : "");
    const look = `${+this.free}${+(r !== null)}${+(g.lost === true)}${+(flags.length > 0)}`;
    if (look !== this.look) {
      this.look = look;
      this.el.classList.toggle("free", this.free);
      this.el.classList.toggle("reserved", r !== null);
      this.el.classList.toggle("lost", g.lost === true);
      this.el.classList.toggle("flagged", flags.length > 0);
    }
    this.updateMig(insts, r, `${this.host}:${index ?? "?"}`);
  }

  /** ``gpuLabel``: ``HOST:GPU``, which an instance's ``HOST:GPU/INSTANCE`` extends. */
  updateMig(insts, whole, gpuLabel) {
    show(this.mig, insts.length > 0);
    while (this.insts.length > insts.length) this.insts.pop().el.remove();
    while (this.insts.length < insts.length) this.insts.push(new InstanceView(this.mig));
    insts.forEach((inst, i) => this.insts[i].update(inst, gpuLabel, whole));
  }

  tick(now) {
    this.res.tick(now);
    for (const i of this.insts) i.res.tick(now);
  }
}

/** One host: its header (status, error, when it last answered) and its GPUs' rows. */
export class HostView {
  constructor(name) {
    this.name = name;
    this.el = el("section", "host");
    this.el.dataset.host = name;
    const head = el("header", "hhead");
    this.title = el("h2", "hname", name);
    this.tags = el("span", "tags");
    this.pill = el("span", "pill");
    this.info = el("span", "hinfo");
    head.append(this.title, this.tags, this.pill, this.info);
    this.err = el("div", "herr");
    this.errKind = el("span", "kind");
    this.errMsg = el("span", "msg");
    this.errLast = el("span", "last");
    this.err.append(this.errKind, this.errMsg, this.errLast);
    this.err.hidden = true;
    this.warn = el("div", "hwarn");
    this.warn.hidden = true;
    this.body = el("div", "gpus");
    this.el.append(head, this.err, this.warn, this.body);
    this.rows = new Map();
    this.order = [];
    this.words = [name.toLowerCase()];
    this.lastOk = null;
    this.failed = false;
    this.look = "";
    this.tagKey = "";
  }

  /** Returns whether the set or order of rows changed. */
  update(h) {
    const error = obj(h.error);
    const kind = error ? str(error.kind, 32) || "error" : "";
    this.failed = h.status !== "ok" || error !== null;
    const look = `${+this.failed}${+(kind === "starting")}`;
    if (look !== this.look) {
      this.look = look;
      this.el.classList.toggle("failed", this.failed);
      this.el.classList.toggle("starting", kind === "starting");
    }
    setText(this.pill, this.failed ? kind || "error" : "ok");
    const tags = list(h.tags).map((t) => str(t, 64)).filter(Boolean);
    if (tags.join("\0") !== this.tagKey) {
      this.tagKey = tags.join("\0");
      this.tags.replaceChildren(...tags.map((t) => el("span", "tag", t)));
    }
    this.words = hostWords(h);
    this.lastOk = parseTime(h.last_ok);
    show(this.err, error !== null);
    if (error !== null) {
      setText(this.errKind, kind);
      setText(this.errMsg, str(error.message, 400));
    }
    const warnings = list(h.warnings).map((w) => str(w, 200)).filter(Boolean);
    show(this.warn, warnings.length > 0);
    setText(this.warn, warnings.join(" \u00b7 "));
    const gpus = list(h.gpus).map(obj).filter(Boolean);
    const keys = gpus.map(gpuKey);
    let changed = keys.length !== this.order.length || keys.some((k, i) => k !== this.order[i]);
    const seen = new Set();
    gpus.forEach((g, i) => {
      let k = keys[i];
      if (seen.has(k)) k = keys[i] = `${k}@${i}`; // two GPUs with one key: both shown
      seen.add(k);
      let row = this.rows.get(k);
      if (!row) {
        row = new GpuView(this.name);
        this.rows.set(k, row);
        changed = true;
      }
      row.update(g);
    });
    for (const k of [...this.rows.keys()]) {
      if (!seen.has(k)) {
        this.rows.get(k).drop();
        this.rows.delete(k);
      }
    }
    this.order = keys;
    const free = [...this.rows.values()].filter((r) => r.free).length;
    setText(this.info, gpus.length ? `${gpus.length} GPU${gpus.length > 1 ? "s" : ""} \u00b7 ${free} free` : "");
    this.tickHead(Date.now()); // (a drawn row's time left was set as it was drawn)
    return changed;
  }

  flush() {
    for (const r of this.rows.values()) r.flush();
  }

  drop() {
    for (const r of this.rows.values()) r.drop();
    this.el.remove();
  }

  gpuRows() {
    return this.order.map((k) => this.rows.get(k)).filter(Boolean);
  }

  /** Rows back into this card, in the host's order (the grouped view). */
  adopt() {
    const rows = this.gpuRows();
    if (rows.some((r, i) => this.body.children[i] !== r.el) || this.body.children.length !== rows.length) {
      this.body.replaceChildren(...rows.map((r) => r.el));
    }
  }

  /** Which rows the filter keeps; whether the card shows at all. */
  filter(ts, freeOnly) {
    const hostHit = matches(ts, this.words);
    const rest = ts.filter((t) => !this.words.some((w) => w.includes(t)));
    let any = false;
    for (const r of this.rows.values()) {
      const on = (!freeOnly || r.free) && (hostHit || matches(rest, r.words));
      show(r.el, on);
      r.shown = on;
      any = any || on;
    }
    return any || (!freeOnly && hostHit && (this.failed || this.rows.size === 0));
  }

  tick(now) {
    this.tickHead(now);
    for (const r of this.rows.values()) r.tick(now);
  }

  /** "last answered ... ago" of a failed host. */
  tickHead(now) {
    if (!this.err.hidden) {
      setText(this.errLast, this.lastOk === null ? "never answered"
        : `last answered ${clock(this.lastOk)} (${duration((now - this.lastOk) / 1000)} ago)`);
    }
  }
}

export { hostName };
