"""`GET /status`: one self-contained page that shows `GET /admin/status` live.

Like /docs (conductor/server/docs.py) it loads nothing from anywhere: its style and script are
inline, allowed by their hashes in its Content-Security-Policy, which forbids every other source;
the only request it makes is its own poll of /admin/status on the origin that served it
(`connect-src 'self'`). It writes what the gateway answers as text, never as HTML, so an instance
name or a rejection message carrying markup stays text.

The admin key is typed into the page and kept in the tab's sessionStorage (gone with the tab, not
shared with other tabs), sent as a Bearer header with each poll.
"""

from __future__ import annotations

import base64
import hashlib

POLL_MS = 1500

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.2em;color:#222}h1{font-size:1.4em;margin:0 0 .4em}
h2{font-size:1.1em;margin:1.2em 0 .3em}table{border-collapse:collapse}
th,td{padding:.15em .7em .15em 0;text-align:left;vertical-align:top;font-variant-numeric:tabular-nums}
th{border-bottom:1px solid #bbb;font-weight:600}#state{color:#555;margin-left:1em}
.bad{color:#b00020;font-weight:600}.ok{color:#1b7f3b}.muted{color:#777}#error{color:#b00020}
details summary{cursor:pointer}.cands td{font-size:.9em;color:#333}
"""
_SCRIPT = """
const KEY = "conductor-admin-key";
const $ = (id) => document.getElementById(id);
let timer = null;
function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function num(x, digits) {
  if (x === null || x === undefined) return "-";
  if (typeof x !== "number") return String(x);
  return Number.isInteger(x) ? String(x) : x.toFixed(digits === undefined ? 3 : digits);
}
function pct(x) { return x === null || x === undefined ? "-" : (100 * x).toFixed(1) + "%"; }
function row(cells, cls) {
  const tr = el("tr", undefined, cls);
  for (const c of cells) tr.append(c instanceof Node ? c : el("td", c));
  return tr;
}
function table(id, head, rows) {
  const t = $(id);
  t.replaceChildren(row(head.map((h) => el("th", h))), ...rows);
}
function kvCell(kv) {
  if (!kv) return el("td", "-", "muted");
  const alarms = Object.entries(kv.alarms || {}).map(([d, cause]) => d + ": " + cause);
  const td = el("td", pct(kv.agreement) + " / " + pct(kv.coverage) + " (" + kv.samples + ")");
  if (alarms.length) td.append(el("span", " ALARM " + alarms.join(", "), "bad"));
  return td;
}
function renderInstances(s) {
  table("instances", ["instance", "role", "state", "probe", "ejected", "panic", "queued prefill tokens",
    "running decodes", "in flight", "KV agreement / coverage"], s.instances.map((i) => {
    const tr = row([i.name, i.role, el("td", i.state, i.state === "healthy" ? "ok" : "bad"),
      i.probe_ok ? "ok" : "failing", el("td", i.ejected ? "EJECTED" : "no", i.ejected ? "bad" : ""),
      el("td", i.panic ? "PANIC" : "no", i.panic ? "bad" : ""),
      num(i.queued_prefill_tokens) + " (" + i.queued_prefills + ")", num(i.running_decodes), num(i.inflight),
      kvCell(i.kv)]);
    tr.dataset.instance = i.name;
    return tr;
  }));
}
function renderWindow(s) {
  const w = s.window;
  const reasons = Object.entries(w.rejections).map(([r, n]) => r + ": " + n).join(", ") || "none";
  $("summary").textContent = "policy " + s.policy + " | in flight " + s.inflight.count + "/" + s.inflight.limit +
    " | panic: " + (s.panic_roles.join(", ") || "none") +
    (s.kv ? " | KV agreement " + pct(s.kv.agreement) + ", coverage " + pct(s.kv.coverage) +
      (s.kv.alarmed ? " ALARM" : "") : "");
  table("window", ["last", "decisions", "rejected (by reason)", "TTFT SLO met", "TBT SLO met", "failed"], [
    row([Math.round(w.window_s / 60) + " min", num(w.decisions), reasons,
      pct(w.ttft_attainment) + " of " + (w.outcomes.ttft_met + w.outcomes.ttft_missed),
      pct(w.tbt_attainment) + " of " + (w.outcomes.tbt_met + w.outcomes.tbt_missed), num(w.outcomes.failed)])]);
  const rej = $("rejections");
  rej.replaceChildren(...Object.entries(w.rejections).map(([r, n]) => {
    const li = el("li", r + ": " + n);
    li.dataset.reason = r;
    return li;
  }));
}
function candidates(d) {
  const t = el("table", undefined, "cands");
  t.append(row(["candidate", "role", "score", "TTFT", "TBT", "detail"].map((h) => el("th", h))));
  for (const c of d.candidates) {
    const detail = Object.entries(c).filter(([k]) => !["instance", "role", "score", "predicted_ttft_s",
      "predicted_tbt_s"].includes(k)).map(([k, v]) => k + "=" + num(v)).join(" ");
    t.append(row([c.instance, c.role, num(c.score), num(c.predicted_ttft_s), num(c.predicted_tbt_s), detail]));
  }
  return t;
}
const opened = new Set();
function renderDecisions(s) {
  table("decisions", ["#", "time", "request", "prompt tokens", "prefill", "decode", "pred. TTFT s",
    "pred. TBT s", "outcome"], s.decisions.map((d) => {
    const box = el("details");
    box.open = opened.has(d.seq);
    box.addEventListener("toggle", () => box.open ? opened.add(d.seq) : opened.delete(d.seq));
    box.append(el("summary", d.request_id), candidates(d));
    const outcome = d.rejection ? el("td", "rejected: " + d.rejection.reason, "bad") : el("td", "routed", "ok");
    const tr = row([num(d.seq), new Date(d.at * 1000).toLocaleTimeString(), el("td"), num(d.prompt_tokens),
      d.prefill || "-", d.decode || "-", num(d.predicted_ttft_s), num(d.predicted_tbt_s), outcome]);
    tr.children[2].append(box);
    tr.dataset.requestId = d.request_id;
    return tr;
  }));
}
async function poll() {
  clearTimeout(timer);
  const key = sessionStorage.getItem(KEY) || "";
  try {
    const r = await fetch("/admin/status", {headers: key ? {Authorization: "Bearer " + key} : {}, cache: "no-store"});
    const body = await r.json();
    if (!r.ok) {
      $("error").textContent = r.status + ": " + ((body.error && body.error.message) || r.statusText);
    } else {
      $("error").textContent = "";
      renderInstances(body); renderWindow(body); renderDecisions(body);
      $("state").textContent = "updated " + new Date().toLocaleTimeString();
    }
  } catch (e) {
    $("error").textContent = "the gateway did not answer: " + e;
  }
  timer = setTimeout(poll, POLL_MS);
}
function useKey() { sessionStorage.setItem(KEY, $("key").value); poll(); }
$("key").value = sessionStorage.getItem(KEY) || "";
$("use").addEventListener("click", useKey);
$("key").addEventListener("keydown", (e) => { if (e.key === "Enter") useKey(); });
poll();
""".replace("POLL_MS", str(POLL_MS))


def _source_hash(source: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(source.encode()).digest()).decode() + "'"


# the inline script and style, and fetches to the page's own origin: nothing else, no form, no frame
STATUS_PAGE_POLICY = (
    f"default-src 'none'; script-src {_source_hash(_SCRIPT)}; style-src {_source_hash(_STYLE)}; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

_PAGE = (
    '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Conductor status</title>'
    f"<style>{_STYLE}</style></head><body>"
    '<h1>Conductor status<span id="state"></span></h1>'
    '<p><label>admin key <input id="key" type="password" autocomplete="off" size="40"></label> '
    '<button id="use" type="button">use</button> <span id="error"></span></p>'
    '<p id="summary"></p>'
    '<h2>Instances</h2><table id="instances"></table>'
    '<h2>Recent minutes</h2><table id="window"></table><ul id="rejections"></ul>'
    '<h2>Recent decisions</h2><table id="decisions"></table>'
    f"<script>{_SCRIPT}</script></body></html>"
)


def status_page() -> str:
    """The page: the same bytes every time (it holds no data; its script fetches it)."""
    return _PAGE
