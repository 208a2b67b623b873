// The side panels: the wait queue, who holds what, and the last day's waste (from the
// hub's history database, when it has one). Rebuilt whole: they are short and bounded.

import { duration, list, num, obj, parseTime, people, str } from "./data.js";
import { el } from "./view.js";

const MAX_ROWS = 30;

function empty(text) {
  return el("p", "empty", text);
}

function more(n) {
  return el("li", "more", `+${n} more`);
}

/** The waiters, first come first (the document's ``queue``). */
export function renderQueue(box, queue, now) {
  const waiters = list(queue).map(obj).filter(Boolean);
  box.count.textContent = String(waiters.length);
  if (!waiters.length) {
    box.list.replaceChildren(empty("nobody waits"));
    return;
  }
  const ol = el("ol", "queue");
  for (const w of waiters.slice(0, MAX_ROWS)) {
    const li = el("li");
    const created = parseTime(w.created);
    const n = num(w.count) ?? 1;
    const hosts = list(w.hosts).map((h) => str(h, 64)).filter(Boolean);
    li.append(el("span", "user", str(w.user, 64) || "?"),
      el("span", "want", `${n} GPU${n === 1 ? "" : "s"}${w.one_host === true ? " on one host" : ""}`),
      el("span", "what", str(w.want, 120) || (hosts.length ? hosts.join(", ") : "any host")),
      el("span", "since", created === null ? "" : `waiting ${duration((now - created) / 1000)}`));
    ol.append(li);
  }
  if (waiters.length > MAX_ROWS) ol.append(more(waiters.length - MAX_ROWS));
  box.list.replaceChildren(ol);
}

/** Per user: what they reserved (with the time left) and how many GPUs they use. */
export function renderPeople(box, hosts, now, reservations = null) {
  const all = people(hosts, now, reservations);
  box.count.textContent = String(all.length);
  if (!all.length) {
    box.list.replaceChildren(empty("no reservations, no processes"));
    return;
  }
  const ul = el("ul", "people");
  for (const p of all.slice(0, MAX_ROWS)) {
    const li = el("li", "person");
    const who = el("div", "who");
    who.append(el("span", "user", p.user));
    if (p.using) who.append(el("span", "using", `uses ${p.using} GPU${p.using === 1 ? "" : "s"}`));
    if (p.held.length) who.append(el("span", "using", `holds ${p.held.length}`));
    li.append(who);
    const held = el("div", "held");
    for (const r of p.held.slice(0, 8)) {
      held.append(el("span", "hold", r.label + (r.left === null ? ""
        : r.left > 0 ? ` (${duration(r.left)})` : " (expired)")));
    }
    if (p.held.length > 8) held.append(el("span", "hold", `+${p.held.length - 8}`));
    li.append(held);
    ul.append(li);
  }
  if (all.length > MAX_ROWS) ul.append(more(all.length - MAX_ROWS));
  box.list.replaceChildren(ul);
}

function pct(x) {
  const v = num(x);
  return v === null ? "n/a" : `${v.toFixed(v < 10 ? 1 : 0)} %`;
}

function hours(x) {
  const v = num(x);
  return v === null ? "n/a" : `${v.toFixed(v < 10 ? 1 : 0)} h`;
}

/** The last day's waste, or why there is none (the panel hides without a database). */
export function renderWaste(box, doc) {
  const d = obj(doc);
  if (!d || (d.available !== true && d.error !== true)) {
    box.el.hidden = true;
    return;
  }
  box.el.hidden = false;
  if (d.available !== true) {
    box.list.replaceChildren(el("p", "problem", `history: ${str(d.reason, 300)}`));
    return;
  }
  const h = obj(d.headline) || {};
  const dl = el("dl", "headline");
  for (const [k, v] of [["GPU-hours", hours(h.gpu_hours)], ["busy", pct(h.busy_percent)],
    ["idle", pct(h.idle_percent)], ["held idle", pct(h.held_idle_percent)]]) {
    dl.append(el("dt", "", k), el("dd", "", v));
  }
  const ul = el("ul", "wasters");
  for (const u of list(d.users).map(obj).filter(Boolean).slice(0, 10)) {
    const li = el("li");
    li.append(el("span", "user", str(u.user, 64) || "?"),
      el("span", "ri", `${hours(u.reserved_idle_hours)} reserved idle`),
      el("span", "hi", `${hours(u.held_idle_hours)} held at 0 %`));
    ul.append(li);
  }
  box.list.replaceChildren(dl, ...(ul.children.length ? [ul] : [empty("nobody wasted any")]));
}
