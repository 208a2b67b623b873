// What the web board shows, worked out without the DOM: values read defensively from the
// hub's document (every field may be missing, of the wrong type or hostile), the board's
// filter, free-only and sort rules (gputop/ui/board_model.py), the URL state, the people.

export const SORTS = ["host", "utilization", "free-memory"];
export const FREE_MEMORY_SLACK_MIB = 512; // gputop.reservations.flags.FREE_MEMORY_SLACK_MIB
/** What each flag means, in words (the board's and the wall's tooltips). */
export const FLAG_WORDS = {
  "unreserved-use": "used without a reservation",
  "idle-reservation": "reserved, unused",
  "idle-holder": "memory held at 0 %",
  lost: "lost",
  renumbered: "renumbered",
};

export const MAX_TEXT = 300; // longer strings are cut: a 1 MiB command line is not a row

/** A finite number, or null (the document says null where a GPU reported nothing). */
export function num(x) {
  return typeof x === "number" && Number.isFinite(x) ? x : null;
}

/** A string, cut to ``max``; anything else is "". Only ever set as text, never as markup. */
export function str(x, max = MAX_TEXT) {
  if (typeof x !== "string") return "";
  return x.length > max ? x.slice(0, max) + "\u2026" : x;
}

export function list(x) {
  return Array.isArray(x) ? x : [];
}

export function obj(x) {
  return x !== null && typeof x === "object" && !Array.isArray(x) ? x : null;
}

/** Milliseconds since 1970 of the document's "2026-12-01T17:00:00Z", or null. */
export function parseTime(x) {
  if (typeof x !== "string" || !/^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$/.test(x)) return null;
  const t = Date.parse(x);
  return Number.isFinite(t) ? t : null;
}

/** "3h 12m", "45m", "20s", "2d 4h". */
export function duration(seconds) {
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m`;
  const h = Math.floor(m / 60);
  if (h < 48) return `${h}h ${String(m % 60).padStart(2, "0")}m`;
  return `${Math.floor(h / 24)}d ${h % 24}h`;
}

export function clock(ms) {
  if (ms === null) return "never";
  const d = new Date(ms);
  return [d.getHours(), d.getMinutes(), d.getSeconds()]
    .map((v) => String(v).padStart(2, "0")).join(":");
}

export function gib(mib) {
  const v = num(mib);
  if (v === null) return "n/a";
  return v >= 1024 ? `${(v / 1024).toFixed(v >= 10240 ? 0 : 1)} GiB` : `${Math.round(v)} MiB`;
}

export function hostName(h) {
  return str(obj(h)?.name, 200);
}

/** The board's key of a GPU within its host: uuid, else index, else bus id, else place. */
export function gpuKey(g, i) {
  return str(g.uuid, 100) || (num(g.index) !== null ? `#${g.index}` : "") ||
    str(g.bus_id, 100) || `@${i}`;
}

export function processes(x) {
  return list(x).map(obj).filter((p) => p !== null);
}

/** Nobody uses it and nobody holds it: no processes, next to no memory, no load. */
/** A GPU's memory shares (docs/shares.md): each a reservation with ``share_mib``. */
export function shares(g) {
  return list(g.shares).map(obj).filter(Boolean);
}

export function isFree(g) {
  if (g.lost === true || num(g.index) === null || list(g.processes).length) return false;
  if (obj(g.reservation) || shares(g).length) return false;  // a shared GPU is not whole
  const used = num(g.memory_used_mib);
  if (used === null || used > FREE_MEMORY_SLACK_MIB) return false;
  const util = num(g.utilization_percent);
  return util === null || util <= 10;
}

export function instanceFree(inst) {
  if (list(inst.processes).length || obj(inst.reservation)) return false;
  const used = num(inst.memory_used_mib);
  return used !== null && used <= FREE_MEMORY_SLACK_MIB;
}

/** A GPU is free, or (MIG) one of its instances is. */
export function anyFree(g) {
  const inst = list(g.instances).map(obj).filter(Boolean);
  if (inst.length) return g.lost !== true && inst.some(instanceFree);
  return isFree(g);
}

export function freeMib(g) {
  const used = num(g.memory_used_mib);
  const total = num(g.memory_total_mib);
  return used === null || total === null ? -1 : total - used;
}

export function users(g) {
  const out = [];
  for (const p of list(g.processes)) {
    const u = str(obj(p)?.user, 64);
    if (u && !out.includes(u)) out.push(u);
  }
  return out;
}

/** The words a filter term may match: the host's (name, tags) and the GPU's (model,
 * users, holder), lowered. */
export function hostWords(h) {
  return [hostName(h), ...list(h.tags).map((t) => str(t, 64))].map((w) => w.toLowerCase());
}

export function gpuWords(g) {
  const w = [str(g.name, 200), ...users(g)];
  const r = obj(g.reservation);
  if (r) w.push(str(r.user, 64));
  for (const s of shares(g)) w.push(str(s.user, 64));
  for (const inst of list(g.instances)) {
    const ir = obj(obj(inst)?.reservation);
    if (ir) w.push(str(ir.user, 64));
  }
  return w.map((x) => x.toLowerCase());
}

export function terms(text) {
  return text.trim().toLowerCase().split(/\s+/).filter(Boolean);
}

/** Every term is in one of the words. */
export function matches(ts, words) {
  return ts.every((t) => words.some((w) => w.includes(t)));
}

/** The view the URL asks for: ?q=&free=1&sort=&tv=1&every=SECONDS. */
export function readState(search) {
  const p = new URLSearchParams(search);
  const sort = p.get("sort");
  const every = Number(p.get("every"));
  return {
    q: (p.get("q") || "").slice(0, 200),
    free: p.get("free") === "1",
    sort: SORTS.includes(sort) ? sort : "host",
    tv: p.get("tv") === "1",
    every: Number.isFinite(every) && every >= 3 && every <= 600 ? every : 12,
  };
}

export function writeState(state) {
  const p = new URLSearchParams();
  if (state.q) p.set("q", state.q);
  if (state.free) p.set("free", "1");
  if (state.sort !== "host") p.set("sort", state.sort);
  if (state.tv) p.set("tv", "1");
  if (state.tv && state.every !== 12) p.set("every", String(state.every));
  const s = p.toString();
  return s ? `?${s}` : "";
}

/** Flat order for the sorted views (as the board): utilisation high first with unknown
 * last, or free memory high first; then host, then index. */
export function compareRows(sort) {
  const tie = (a, b) => (a.host < b.host ? -1 : a.host > b.host ? 1 : a.index - b.index);
  if (sort === "utilization") {
    return (a, b) => {
      const ua = a.util === null, ub = b.util === null;
      if (ua !== ub) return ua ? 1 : -1;
      return (b.util ?? 0) - (a.util ?? 0) || tie(a, b);
    };
  }
  return (a, b) => b.freeMib - a.freeMib || tie(a, b);
}

/** Who holds what: per user, the reservations held and the GPUs their processes are on. */
export function people(hosts, now, reservations = null) {
  const by = new Map();
  const get = (u) => {
    let e = by.get(u);
    if (!e) by.set(u, (e = { user: u, held: [], using: 0 }));
    return e;
  };
  const ids = new Set(); // reservations shown on a GPU (the rest: below)
  const add = (r, what) => {
    const u = str(r.user, 64);
    if (!u) return;
    const exp = parseTime(r.expires);
    get(u).held.push({ label: what, left: exp === null ? null : (exp - now) / 1000 });
  };
  const down = new Set();
  for (const h of hosts) {
    const name = hostName(h);
    if (h.status !== "ok") down.add(name);
    for (const g of list(h.gpus).map(obj).filter(Boolean)) {
      const label = `${name}:${num(g.index) ?? "?"}`;
      const seen = new Set();
      const hold = (r, what) => {
        const u = str(r.user, 64);
        if (typeof r.id === "string") ids.add(r.id);
        if (!u || seen.has(`r${u}${what}`)) return;
        seen.add(`r${u}${what}`);
        add(r, what);
      };
      const r = obj(g.reservation);
      if (r) hold(r, label);
      for (const s of shares(g)) hold(s, `${label} (${gib(s.share_mib)} share)`);
      for (const inst of list(g.instances).map(obj).filter(Boolean)) {
        const ir = obj(inst.reservation);
        if (ir && num(ir.instance) !== null) hold(ir, `${label}/${num(ir.instance)}`);
      }
      for (const u of users(g)) get(u).using += 1;
    }
  }
  // Reservations no GPU showed (a host that is down reports none): held all the same,
  // but not those whose end has passed (the hub lists them again only when the file
  // changes), each once per holder and label.
  const polled = new Set(hosts.map(hostName));
  const shown = new Set();
  for (const r of list(reservations).map(obj).filter(Boolean)) {
    if (typeof r.id !== "string" || ids.has(r.id)) continue;
    ids.add(r.id);
    const exp = parseTime(r.expires);
    if (exp !== null && exp <= now) continue;
    const gi = num(r.instance);
    const size = num(r.share_mib);
    const host = str(r.host, 256) || "?";
    const label = `${host}:${num(r.gpu) ?? "?"}${gi === null ? "" : `/${gi}`}` +
      (size === null ? "" : ` (${gib(size)} share)`) +
      (down.has(host) ? " (host down)" : polled.has(host) ? "" : " (not polled here)");
    const key = `${str(r.user, 64)}\u0000${label}`;
    if (shown.has(key)) continue;
    shown.add(key);
    add(r, label);
  }
  return [...by.values()].sort((a, b) =>
    b.held.length + b.using - (a.held.length + a.using) || (a.user < b.user ? -1 : 1));
}

/** The summary line: the document's ``summary``, which the hub counts once by the rule
 * every gputop view shows (docs/json.md: each GPU in exactly one class), never a count of
 * the page's own; then the mean load of the GPUs that report one. "" without a summary. */
export function summaryText(sum, hosts) {
  const s = obj(sum);
  const h = obj(s?.hosts);
  const g = obj(s?.gpus);
  const m = obj(s?.instances);
  if (h === null || g === null) return "";
  const n = (o, k) => Math.max(0, Math.trunc(num(o?.[k]) ?? 0));
  const all = n(h, "up") + n(h, "down") + n(h, "waiting");
  const hostNote = [n(h, "down") ? `${n(h, "down")} down` : "",
    n(h, "waiting") ? `${n(h, "waiting")} waiting` : ""].filter(Boolean).join(", ");
  let text = `${all} hosts${hostNote ? ` (${hostNote})` : ""} \u00b7 ${n(g, "total")} GPUs` +
    ` \u00b7 ${n(g, "free")} free \u00b7 ${n(g, "busy")} busy \u00b7 ${n(g, "reserved")} reserved`;
  for (const k of ["shared", "down", "unknown"]) if (n(g, k)) text += ` \u00b7 ${n(g, k)} ${k}`;
  if (m !== null && n(m, "total")) text += ` \u00b7 MIG ${n(m, "free")} free of ${n(m, "total")}`;
  let util = 0;
  let utilN = 0;
  for (const host of hosts) {
    for (const gpu of list(host?.gpus).map(obj).filter(Boolean)) {
      const u = num(gpu.utilization_percent);
      if (u !== null) {
        util += u;
        utilN += 1;
      }
    }
  }
  return text + (utilN ? ` \u00b7 ${Math.round(util / utilN)}% mean load` : "");
}

/** ``fields`` written onto ``target`` as own data keys (as a spread writes them: a
 * "__proto__" key stays a plain key, where ``Object.assign`` would set the prototype). */
function put(target, fields) {
  for (const k in fields) {
    if (!Object.hasOwn(fields, k)) continue;
    if (k === "__proto__") { // (the one accessor every object inherits)
      Object.defineProperty(target, k,
        { value: fields[k], writable: true, enumerable: true, configurable: true });
    } else {
      target[k] = fields[k];
    }
  }
}

/** A ``patch`` event's ``changes`` applied to copies of the hosts they name (``hosts``:
 * name -> host object, as they are once the patch's complete hosts are in; anything with
 * a ``get(name)``): a Map of
 * name -> the new host object, each changed GPU a new object and every other GPU the
 * same object as before (so its row can tell it is unchanged). Null, with nothing
 * applied, when any change does not fit: not an object, a host not known, a GPU position
 * the host does not have, a key a change may not carry (docs/hub.md). Each host and GPU
 * is copied once per patch and then written in place: the cost is the patch's size,
 * however often it names one host or position. A change's name is read as a host's name
 * is (cut as ``hostName`` cuts it), so it finds the host the page keeps under that name. */
export function patched(hosts, changes) {
  if (!Array.isArray(changes)) return null;
  const out = new Map();
  const made = new Set(); // the GPU objects this patch made (written in place after)
  for (const c of changes) {
    const name = obj(c) === null || typeof c.name !== "string" ? "" : hostName(c);
    const set = obj(c?.set);
    if (!name || set === null || !Array.isArray(c.gpus)) return null;
    if (Object.hasOwn(set, "name") || Object.hasOwn(set, "gpus")) return null;
    let h = out.get(name);
    if (h === undefined) {
      const was = obj(hosts.get(name));
      if (was === null || !Array.isArray(was.gpus)) return null;
      h = { ...was, gpus: [...was.gpus] };
      out.set(name, h);
    }
    put(h, set);
    for (const item of c.gpus) {
      const pos = Array.isArray(item) ? item[0] : null;
      const fields = Array.isArray(item) ? obj(item[1]) : null;
      if (!Number.isInteger(pos) || pos < 0 || pos >= h.gpus.length || fields === null) {
        return null;
      }
      let g = h.gpus[pos];
      if (!made.has(g)) {
        g = h.gpus[pos] = { ...obj(g) };
        made.add(g);
      }
      put(g, fields);
    }
  }
  return out;
}
