"""The live page itself: one HTML document, its style and a little script that polls
``/api/job`` twice a second. Everything from the job is put in with ``textContent``
(never as HTML): a file name or an error text cannot inject markup.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["PAGE", "render_page"]


def render_page(data: dict[str, Any]) -> str:
    """The page with ``data`` (``/api/job``'s answer) inside, so it shows the job at once,
    before its first poll; ``<`` is escaped so no text can close the script element."""
    inline = json.dumps(data, default=str).replace("<", "\\u003c").replace("&", "\\u0026")
    return PAGE.replace("__INITIAL__", inline, 1)

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>rankwise job</title>
<style>
body{font:14px system-ui,sans-serif;margin:1em 1.5em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:.2em 0}
#summary{color:#555;margin-bottom:.8em}
table{border-collapse:collapse;width:100%;background:#fff}
th,td{border:1px solid #ddd;padding:4px 6px;text-align:left;vertical-align:top}
th{background:#eee}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.state{font-family:ui-monospace,monospace;font-size:12px;max-width:46em}
td.recent{font-family:ui-monospace,monospace;font-size:11px;color:#444}
tr.stuck{background:#ffe3e0}
tr.stuck td.state{color:#a00;font-weight:600}
tr.silent{background:#fff4cc}
tr.unseen{color:#999}
tr.failed{background:#f8d0d0}
pre{background:#fff;border:1px solid #ccc;padding:.6em;overflow:auto;font-size:12px;
    white-space:pre-wrap}
#report{border:2px solid #c00;display:none}
#straggler{display:none;background:#fff4cc;border:1px solid #d9a400;padding:.4em .6em;
           margin-bottom:.8em;font-family:ui-monospace,monospace;font-size:12px;
           white-space:pre-line}
tr.straggler td.wait{background:#fde68a;font-weight:600}
#report h2{color:#c00;font-size:1.1em;margin:.2em 0}
button{font-size:12px}
</style></head>
<body>
<h1>rankwise job</h1>
<div id="summary">connecting...</div>
<div id="straggler"></div>
<div id="report"><h2 id="report-title">failure</h2><pre id="report-text"></pre></div>
<table><thead><tr><th>rank</th><th>host</th><th>pid</th><th>state</th>
<th>heartbeat</th>
<th title="median wait per call; the rank the others wait for waits least">wait/call</th>
<th>calls/s</th><th>bytes/s</th><th>last collectives</th><th></th>
</tr></thead><tbody id="rows"></tbody></table>
<div id="stacks-box" style="display:none"><h2 id="stacks-title">stacks</h2>
<pre id="stacks"></pre></div>
<script id="initial" type="application/json">__INITIAL__</script>
<script>
"use strict";
const token = new URLSearchParams(location.search).get("token") || "";
const q = "token=" + encodeURIComponent(token);
function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function human(n) {
  const u = ["B", "KB", "MB", "GB", "TB"]; let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return (i ? n.toFixed(1) : Math.round(n)) + " " + u[i] + "/s";
}
async function showStacks(rank) {
  const box = document.getElementById("stacks-box");
  box.style.display = "block";
  document.getElementById("stacks-title").textContent = "rank " + rank + ": asking...";
  const r = await fetch("/api/stacks?rank=" + rank + "&" + q);
  const d = await r.json();
  document.getElementById("stacks-title").textContent = "rank " + rank + " stacks";
  document.getElementById("stacks").textContent = d.stacks || d.error || "";
}
function render(d) {
  const seen = d.ranks.filter(r => r.seen).length;
  const stuck = d.ranks.filter(r => r.stuck).length;
  document.getElementById("summary").textContent =
    d.world_size + " ranks, " + seen + " reporting, " + stuck + " in a call for > 1 s" +
    (d.attempt ? ", restart " + d.attempt : "") + "; up " +
    Math.round(d.now - d.started) + " s";
  const held = new Set((d.stragglers || []).map(s => s.rank));
  const st = document.getElementById("straggler");
  st.style.display = held.size ? "block" : "none";
  st.textContent = (d.stragglers || []).map(s => "straggler: " + s.text).join("\n");
  const body = document.getElementById("rows");
  body.replaceChildren();
  for (const r of d.ranks) {
    const tr = el("tr");
    tr.id = "rank-" + r.rank;
    tr.className = !r.seen ? "unseen" : r.failed ? "failed" : r.stuck ? "stuck" :
                   r.silent ? "silent" : "";
    if (held.has(r.rank)) tr.className += " straggler";
    tr.append(el("td", r.rank, "num"), el("td", r.host || ""), el("td", r.pid || "", "num"));
    const failed = r.failed ? "raised " + r.failed.split("\n")[0].slice(0, 110) : "";
    tr.append(el("td", failed ? failed + (r.was ? " \u2014 was " + r.was : "") : r.state,
                 "state"));
    tr.append(el("td", r.seen ? r.heartbeat_age.toFixed(1) + " s" : "", "num"));
    tr.append(el("td", r.wait_ms == null ? "" : r.wait_ms.toFixed(1) + " ms", "num wait"));
    tr.append(el("td", r.seen ? r.calls_per_s : "", "num"));
    tr.append(el("td", r.seen ? human(r.bytes_per_s) : "", "num"));
    const rec = el("td", undefined, "recent");
    for (const c of (r.recent || []).slice(0, 4)) {
      rec.append(el("div", c.call + " #" + c.seq + " " + c.ms.toFixed(2) + " ms"));
    }
    tr.append(rec);
    const td = el("td");
    if (r.seen) {
      const b = el("button", "stacks");
      b.onclick = () => showStacks(r.rank);
      td.append(b);
    }
    tr.append(td);
    body.append(tr);
  }
  const rep = document.getElementById("report");
  if (d.report) {
    rep.style.display = "block";
    document.getElementById("report-title").textContent = "rank " + d.report.rank +
      " failed" + (d.report.also.length ? " (then ranks " + d.report.also.join(", ") + ")" : "");
    document.getElementById("report-text").textContent = d.report.text;
  } else {
    rep.style.display = "none";
  }
}
async function poll() {
  try {
    const r = await fetch("/api/job?" + q);
    if (r.ok) render(await r.json());
    else document.getElementById("summary").textContent = "error " + r.status;
  } catch (e) {
    document.getElementById("summary").textContent = "the launcher is gone (job ended)";
  }
  setTimeout(poll, 500);
}
render(JSON.parse(document.getElementById("initial").textContent));
setTimeout(poll, 500);
</script>
</body></html>
"""
