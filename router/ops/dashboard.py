"""``GET /dashboard``: a live status page of the router, one self-contained HTML page.

The page holds no data of its own: its inline script reads the router's ``/metrics``
(Prometheus text) every 2 s and renders instances, predicted vs
measured TTFT, hit tokens by tier, requests and rejections, and hot prefixes. No build
step and nothing fetched from elsewhere (no CDN, fonts or images): it works offline and
behind a path prefix (``metrics`` is fetched relative to the page).

Contract for tests and scrapers: every number shown carries ``data-metric`` naming the
sample it shows, as ``name{label=value,...}`` (the exposition name, ``_total`` included;
labels in the order the page lists them; instance rows omit ``role``), or an ``id`` for
derived values (``ttft-actual-mean`` in ms, ``ttft-error-median``, ...). Counts are shown
as integers, other values with fixed decimals and no thousands separators. A failed
fetch shows ``#error`` and keeps the last rendered numbers.

With any key configured the page needs what ``/metrics`` needs (the admin or the metrics
key, :meth:`kvcentric.router.api.auth.Authenticator.check_metrics`): a browser asked with
``WWW-Authenticate: Basic`` prompts once (any user name, the key as password) and then
sends the same credentials with the page's own fetches of ``metrics``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from starlette.responses import HTMLResponse, Response

from kvcentric.router.api.errors import Refused

if TYPE_CHECKING:
    from kvcentric.router.api.app import RouterState

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>kvcentric router</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f4f5f7;color:#222}
header{display:flex;justify-content:space-between;align-items:baseline;padding:10px 20px;
 background:#1f2937;color:#fff}
header h1{font-size:18px;margin:0}
main{display:grid;grid-template-columns:repeat(auto-fit,minmax(380px,1fr));gap:14px;
 padding:14px 20px}
section{background:#fff;border-radius:6px;padding:10px 14px;box-shadow:0 1px 2px #0002}
section.wide{grid-column:1/-1}
h2{font-size:15px;margin:2px 0 8px}
table+h2{margin-top:16px}
table{border-collapse:collapse;width:100%}
th,td{padding:3px 8px;border-bottom:1px solid #eee;text-align:right}
th:first-child,td:first-child{text-align:left}
th{font-weight:600;color:#555}
.up{color:#15803d;font-weight:600}.down{color:#b91c1c;font-weight:600}
.muted{color:#888}
#error{background:#fee2e2;color:#991b1b;padding:8px 20px;font-weight:600}
</style></head>
<body>
<header><h1>kvcentric router</h1>
<span>updated <span id="updated">never</span></span></header>
<div id="error" hidden></div>
<main>
<section class="wide"><h2>Instances</h2>
<table><thead><tr><th>name</th><th>role</th><th>health</th><th>running</th><th>waiting</th>
<th>KV usage</th><th>queue (s)</th><th>decodes</th><th>resident blocks</th></tr></thead>
<tbody id="instances"></tbody></table></section>
<section><h2>TTFT: predicted vs actual</h2>
<table><thead><tr><th></th><th>count</th><th>mean (ms)</th></tr></thead><tbody>
<tr><td>predicted (every decision)</td>
<td id="ttft-predicted-count" data-metric="kvc_router_ttft_predicted_seconds_count"></td>
<td id="ttft-predicted-mean"></td></tr>
<tr><td>actual (streamed)</td>
<td id="ttft-actual-count" data-metric="kvc_router_ttft_actual_seconds_count"></td>
<td id="ttft-actual-mean"></td></tr>
</tbody></table>
<p>median |actual &minus; predicted| / actual:
<b id="ttft-error-median">&ndash;</b> <span id="ttft-error-bound" class="muted"></span>
over <span id="ttft-error-count" data-metric="kvc_router_ttft_relative_error_count"></span>
requests</p></section>
<section><h2>Hit tokens by tier (predicted)</h2>
<table><thead><tr><th>tier</th><th>tokens</th><th>of prompt</th></tr></thead><tbody>
<tr><td>engine cache</td>
<td data-metric="kvc_router_predicted_hit_tokens_by_tier_total{tier=engine}"></td>
<td id="hit-share-engine"></td></tr>
<tr><td>store DRAM</td>
<td data-metric="kvc_router_predicted_hit_tokens_by_tier_total{tier=store_dram}"></td>
<td id="hit-share-store_dram"></td></tr>
<tr><td>store disk</td>
<td data-metric="kvc_router_predicted_hit_tokens_by_tier_total{tier=store_disk}"></td>
<td id="hit-share-store_disk"></td></tr>
<tr><td>prompt tokens routed</td>
<td id="prompt-tokens" data-metric="kvc_router_prompt_tokens_total"></td><td></td></tr>
</tbody></table></section>
<section><h2>Requests</h2>
<table><thead><tr><th>endpoint</th><th>status</th><th>count</th></tr></thead>
<tbody id="requests"></tbody></table>
<h2>Rejections (429/503)</h2>
<table><thead><tr><th>reason</th><th>count</th></tr></thead>
<tbody id="rejections"></tbody></table></section>
<section><h2>Hot prefixes</h2>
<table><thead><tr><th>prefix (root block)</th><th>heat</th><th>replicas</th></tr>
</thead><tbody id="prefixes"></tbody></table></section>
</main>
<script>
"use strict";
const REFRESH_MS = 2000;
const $ = (id) => document.getElementById(id);
const NUM = {"+Inf": Infinity, "-Inf": -Infinity};

function parse(text) {  // Prometheus text format -> [{name, labels, value}]
  const out = [];
  for (const line of text.split("\n")) {
    const m = /^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m) continue;  // comments, blank lines
    const labels = {};
    for (const l of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) {
      labels[l[1]] = l[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    }
    out.push({name: m[1], labels, value: m[3] in NUM ? NUM[m[3]] : parseFloat(m[3])});
  }
  return out;
}

const key = (name, labels, keys) =>
  keys.length ? name + "{" + keys.map((k) => k + "=" + labels[k]).join(",") + "}" : name;
const int = (v) => (Number.isFinite(v) ? v.toFixed(0) : "\u2013");
const fixed = (v, d) => (Number.isFinite(v) ? v.toFixed(d) : "\u2013");
const pct = (v, d) => (Number.isFinite(v) ? (100 * v).toFixed(d) + "%" : "\u2013");

function put(el, text, metric) {
  el.textContent = text;
  if (metric) el.dataset.metric = metric;
  return el;
}

function row(body, cells) {  // cells: [text, metric or null, class or null]
  const tr = body.insertRow();
  for (const [text, metric, cls] of cells) {
    const td = put(tr.insertCell(), text, metric);
    if (cls) td.className = cls;
  }
  if (cells.length === 1) tr.cells[0].colSpan = body.parentElement.tHead.rows[0].cells.length;
  return tr;
}

function fill(id, samples, keys, fmt) {  // one row per sample, sorted by its labels
  const body = $(id);
  body.replaceChildren();
  samples.sort((a, b) => keys.map((k) => a.labels[k]).join("\0")
    .localeCompare(keys.map((k) => b.labels[k]).join("\0")));
  for (const s of samples) {
    row(body, [...keys.map((k) => [s.labels[k]]), ...fmt(s)]);
  }
  if (!samples.length) row(body, [["none", null, "muted"]]);
}

function median(buckets) {  // [[le, cumulative count]] -> [estimate text, bound text]
  buckets.sort((a, b) => a[0] - b[0]);
  const total = buckets.length ? buckets[buckets.length - 1][1] : 0;
  if (!total) return ["\u2013", ""];
  const rank = total / 2;
  let lo = 0, below = 0;
  for (const [le, cum] of buckets) {
    if (cum >= rank) {
      if (le === Infinity) return ["> " + pct(lo, 0), ""];
      // linear within the bucket, as Prometheus' histogram_quantile
      const est = lo + (le - lo) * (rank - below) / (cum - below);
      return [pct(est, 1), "(\u2264 " + pct(le, 0) + ")"];
    }
    lo = le; below = cum;
  }
  return ["\u2013", ""];
}

function render(samples) {
  const by = (name) => samples.filter((s) => s.name === name);
  const one = (name) => by(name).reduce((t, s) => t + s.value, 0);
  const inst = {};
  for (const s of samples) {
    if (s.name.startsWith("kvc_router_instance_")) {
      (inst[s.labels.instance] ||= {})[s.name.slice(20)] = s;
    }
  }
  const body = $("instances");
  body.replaceChildren();
  for (const name of Object.keys(inst).sort()) {
    const m = inst[name], v = (k) => (m[k] ? m[k].value : NaN);
    const id = (k) => key("kvc_router_instance_" + k, {instance: name}, ["instance"]);
    const up = v("healthy") === 1;
    row(body, [[name], [m.healthy ? m.healthy.labels.role : ""],
      [up ? "up" : "down", id("healthy"), up ? "up" : "down"],
      [int(v("running")), id("running")], [int(v("waiting")), id("waiting")],
      [pct(v("kv_usage"), 1), id("kv_usage")], [fixed(v("queue_seconds"), 2), id("queue_seconds")],
      [int(v("decodes")), id("decodes")], [int(v("resident_blocks")), id("resident_blocks")]]);
  }
  if (!Object.keys(inst).length) row(body, [["no instances", null, "muted"]]);
  for (const kind of ["predicted", "actual"]) {
    const base = "kvc_router_ttft_" + kind + "_seconds";
    const n = one(base + "_count");
    put($("ttft-" + kind + "-count"), int(n));
    put($("ttft-" + kind + "-mean"), n ? fixed(1000 * one(base + "_sum") / n, 1) : "\u2013");
  }
  const err = median(by("kvc_router_ttft_relative_error_bucket").map(
    (s) => [NUM[s.labels.le] ?? parseFloat(s.labels.le), s.value]));
  put($("ttft-error-median"), err[0]);
  put($("ttft-error-bound"), err[1]);
  put($("ttft-error-count"), int(one("kvc_router_ttft_relative_error_count")));
  const prompt = one("kvc_router_prompt_tokens_total");
  put($("prompt-tokens"), int(prompt));
  for (const tier of ["engine", "store_dram", "store_disk"]) {
    const name = "kvc_router_predicted_hit_tokens_by_tier_total";
    const n = by(name).filter((s) => s.labels.tier === tier).reduce((t, s) => t + s.value, 0);
    put(document.querySelector('[data-metric="' + key(name, {tier}, ["tier"]) + '"]'), int(n));
    put($("hit-share-" + tier), prompt ? pct(n / prompt, 1) : "\u2013");
  }
  fill("requests", by("kvc_router_requests_total"), ["endpoint", "status"],
    (s) => [[int(s.value), key(s.name, s.labels, ["endpoint", "status"])]]);
  fill("rejections", by("kvc_router_rejections_total"), ["reason"],
    (s) => [[int(s.value), key(s.name, s.labels, ["reason"])]]);
  const reps = {};
  for (const s of by("kvc_router_prefix_replicas")) reps[s.labels.prefix] = s.value;
  fill("prefixes", by("kvc_router_prefix_heat"), ["prefix"], (s) => [
    [fixed(s.value, 2), key(s.name, s.labels, ["prefix"])],
    [int(reps[s.labels.prefix]), key("kvc_router_prefix_replicas", s.labels, ["prefix"])]]);
}

async function refresh() {
  try {
    const r = await fetch("metrics", {cache: "no-store", credentials: "same-origin"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(parse(await r.text()));
    $("error").hidden = true;
    $("updated").textContent = new Date().toLocaleTimeString();
  } catch (e) {
    $("error").textContent = "cannot read /metrics: " + e.message + " (showing the last values)";
    $("error").hidden = false;
  }
}
refresh();
setInterval(refresh, REFRESH_MS);
</script></body></html>
"""


def dashboard_routes(app: FastAPI, state: RouterState) -> None:
    """Register ``GET /dashboard``, guarded like ``/metrics`` (whose numbers it shows; the
    page reads them from the browser: no other server-side state)."""

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard(request: Request) -> Response:
        try:
            state.auth.check_metrics(request.headers)
        except Refused as refused:
            return refused.response()
        return HTMLResponse(PAGE, headers={"cache-control": "no-cache"})
