// cubegate console: progressive enhancement for server-rendered pages. Every page works
// without this file except the live parts: charts, the exec console's streaming, the audit tail.
// Text only ever goes into the page as text (textContent), never as markup.
"use strict";

(function () {
  const csrf = () => document.body.dataset.csrf || "";
  const SVG = "http://www.w3.org/2000/svg";

  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  function svgEl(tag, attrs) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    return e;
  }

  // -- destructive forms ask first ---------------------------------------------------
  document.addEventListener("submit", (ev) => {
    const form = ev.target;
    if (form.dataset && form.dataset.confirm && !window.confirm(form.dataset.confirm)) ev.preventDefault();
  });

  // -- overview ------------------------------------------------------------------------
  function fmt(v, unit) {
    if (v === null || v === undefined) return "—";
    if (unit === "B/s") {
      const units = ["B/s", "KiB/s", "MiB/s", "GiB/s"];
      let i = 0;
      while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
      return v.toFixed(i ? 1 : 0) + " " + units[i];
    }
    if (unit === "s") return v < 1 ? (v * 1000).toFixed(0) + " ms" : v.toFixed(2) + " s";
    if (unit === "") return (v * 100).toFixed(0) + " %";
    return (Math.round(v * 100) / 100) + " " + unit;
  }

  function drawChart(fig, t, named, unit, fixedMax) {
    let svg = fig.querySelector("svg");
    if (!svg) {
      svg = svgEl("svg", { viewBox: "0 0 400 110", role: "img", preserveAspectRatio: "none" });
      fig.appendChild(svg);
      fig.appendChild(el("p", { class: "legend" }));
    }
    svg.setAttribute("aria-label", fig.querySelector("figcaption").textContent);
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const W = 400, H = 110, L = 4, B = 14, T = 12;
    let max = fixedMax || 0;
    for (const values of Object.values(named)) for (const v of values) if (v !== null && v > max) max = v;
    if (!max) max = 1;
    svg.appendChild(svgEl("line", { class: "axis", x1: L, y1: H - B, x2: W, y2: H - B }));
    const top = svgEl("text", { x: L + 2, y: 10 });
    top.textContent = "max " + fmt(max, unit);
    svg.appendChild(top);
    // the x axis spans what the ring holds: 15 minutes once the daemon has run that long
    const now = t.length ? t[t.length - 1] : 0;
    const span = t.length > 1 ? Math.min(900, Math.max(10, now - t[0])) : 900;
    const start = svgEl("text", { x: L + 2, y: H - 2 });
    start.textContent = span >= 120 ? "−" + Math.round(span / 60) + " min" : "−" + Math.round(span) + " s";
    svg.appendChild(start);
    const end = svgEl("text", { x: W - 24, y: H - 2 });
    end.textContent = "now";
    svg.appendChild(end);
    const x = (ts) => L + (W - L) * (1 - Math.min(span, now - ts) / span);
    const y = (v) => H - B - (H - B - T) * (v / max);
    const legend = fig.querySelector(".legend");
    legend.textContent = "";
    Object.entries(named).forEach(([name, values], i) => {
      let pts = [];
      const flush = () => {   // a lone point (one start in a minute) is a dot, not an invisible line
        if (pts.length === 1) {
          const [cx, cy] = pts[0].split(",");
          svg.appendChild(svgEl("circle", { class: "s" + i, cx: cx, cy: cy, r: 2.5 }));
        } else if (pts.length) {
          svg.appendChild(svgEl("polyline", { class: "s" + i, points: pts.join(" ") }));
        }
        pts = [];
      };
      values.forEach((v, j) => {
        if (v === null) { flush(); return; }
        pts.push(x(t[j]).toFixed(1) + "," + y(v).toFixed(1));
      });
      flush();
      let last = null;
      for (let j = values.length - 1; j >= 0; j--) if (values[j] !== null) { last = values[j]; break; }
      legend.appendChild(el("span", { class: "k" + i }, name + ": " + fmt(last, unit)));
    });
  }

  function renderOverview(d) {
    const badge = document.getElementById("ready-badge");
    badge.textContent = d.ready ? "ready" : "not ready";
    badge.className = "badge " + (d.ready ? "ok" : "bad");
    const body = document.querySelector("#checks tbody");
    body.textContent = "";
    for (const [name, c] of Object.entries(d.checks)) {
      const tr = el("tr", { "data-check": name });
      tr.appendChild(el("td", {}, name));
      tr.appendChild(el("td", { class: c.ok ? "ok" : "bad" }, c.ok ? "ok" : "failing"));
      tr.appendChild(el("td", { class: "detail" }, c.detail));
      body.appendChild(tr);
    }
    const cap = d.capacity;
    const mem = document.getElementById("cap-mem");
    if (mem) mem.textContent = cap.mem_available_mb + " MB available of " + cap.mem_total_mb + " MB";
    if (cap.reserved && document.getElementById("cap-reserved")) {
      document.getElementById("cap-reserved").textContent =
        cap.reserved.memory_mb + " MB · " + cap.reserved.cpus + " CPUs · " + cap.reserved.sandboxes + " sandboxes";
      document.getElementById("cap-measured").textContent = fmt(cap.measured_memory_bytes, "B/s").replace("/s", "");
    }
    const top = document.querySelector("#top-denied tbody");
    top.textContent = "";
    for (const row of d.series.top_denied) {
      const tr = el("tr");
      tr.appendChild(el("td", {}, row.host));
      tr.appendChild(el("td", { class: "num" }, row.count));
      top.appendChild(tr);
    }
    if (!d.series.top_denied.length) {
      const tr = el("tr", { class: "empty" });
      tr.appendChild(el("td", { colspan: "2" }, "none"));
      top.appendChild(tr);
    }
    const s = d.series;
    for (const fig of document.querySelectorAll("figure.chart")) {
      const key = fig.dataset.chart;
      const named = key === "success_rate" ? { "ok/all": s.success_rate } : s[key];
      drawChart(fig, s.t, named, fig.dataset.unit, fig.dataset.max ? Number(fig.dataset.max) : 0);
    }
    const w = s.window, sum = document.getElementById("window-summary");
    if (w && w.seconds !== undefined) {
      sum.textContent = "Over " + Math.round(w.seconds) + " s: " + w.starts + " sandbox starts (p50 " + fmt(w.p50, "s") +
        ", p95 " + fmt(w.p95, "s") + ", p99 " + fmt(w.p99, "s") + "), " + w.creations + " creations, success " +
        fmt(w.success_rate, "") + ".";
    }
  }

  function startOverview(section) {
    const url = section.dataset.refresh, every = Math.max(1, Number(section.dataset.interval || 5)) * 1000;
    const tick = async () => {
      try {
        const r = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
        if (r.status === 401) { location.href = "/login"; return; }
        if (r.ok) renderOverview(await r.json());
      } catch (e) { /* the next tick tries again */ }
      setTimeout(tick, every);
    };
    tick();
  }

  // -- exec console ----------------------------------------------------------------------
  function startExec(form) {
    const out = document.getElementById("exec-output"), status = document.getElementById("exec-status");
    const button = form.querySelector("button[type=submit]");
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      out.textContent = "";
      status.textContent = "starting…";
      button.disabled = true;
      let reply;
      try {
        reply = await fetch(form.action, {
          method: "POST", credentials: "same-origin", body: new URLSearchParams(new FormData(form)),
          headers: { "X-CSRF-Token": csrf(), "X-Console-Fetch": "1", Accept: "application/json" } });
      } catch (e) { status.textContent = "request failed"; button.disabled = false; return; }
      if (reply.status !== 202) {
        let msg = "refused (" + reply.status + ")";
        try { msg = (await reply.json()).message || msg; } catch (e) { /* not JSON: keep the status */ }
        status.textContent = msg;
        button.disabled = false;
        return;
      }
      const job = await reply.json();
      status.textContent = "running…";
      const es = new EventSource(job.events);
      es.addEventListener("output", (m) => {
        const d = JSON.parse(m.data);
        out.appendChild(el("span", { class: d.stream }, d.text));
        out.scrollTop = out.scrollHeight;
      });
      const end = (text) => { es.close(); status.textContent = text; button.disabled = false; };
      es.addEventListener("exit", (m) => {
        const d = JSON.parse(m.data);
        end("exit " + d.exit_code + (d.timed_out ? " (timed out)" : "") + " · " + d.duration_s + " s");
      });
      es.addEventListener("failed", (m) => end("failed: " + JSON.parse(m.data).message));
      es.onerror = () => { if (es.readyState === EventSource.CLOSED) end("stream closed"); };
    });
  }

  // -- audit tail ------------------------------------------------------------------------
  const TAIL_ROWS = 200;

  function recordRow(r) {
    const tr = el("tr");
    const extra = r.extra || {};
    tr.appendChild(el("td", {}, r.ts || ""));
    tr.appendChild(el("td", {}, r.event || ""));
    tr.appendChild(el("td", {}, r.sandbox || ""));
    tr.appendChild(el("td", {}, extra.actor || ""));
    tr.appendChild(el("td", {}, (r.host || "") + (r.port ? ":" + r.port : "")));
    tr.appendChild(el("td", {}, ((r.method || "") + " " + (r.path || extra.action || "")).trim()));
    tr.appendChild(el("td", { class: "d-" + (r.decision || "none") }, r.decision || ""));
    tr.appendChild(el("td", {}, r.reason || ""));
    tr.appendChild(el("td", { class: "num" }, r.status === undefined || r.status === null ? "" : r.status));
    return tr;
  }

  function startTail(section) {
    const body = section.querySelector("tbody"), state = document.getElementById("tail-state");
    const es = new EventSource(section.dataset.stream);
    const say = (text, cls) => { state.textContent = text; state.className = "badge " + (cls || ""); };
    es.addEventListener("hello", () => say("live", "ok"));
    es.addEventListener("record", (m) => {
      const empty = body.querySelector("tr.empty");
      if (empty) empty.remove();
      body.insertBefore(recordRow(JSON.parse(m.data)), body.firstChild);
      while (body.children.length > TAIL_ROWS) body.removeChild(body.lastChild);
    });
    es.addEventListener("skipped", (m) => say("live (" + JSON.parse(m.data).count + " records skipped)", "ok"));
    es.addEventListener("end", () => { es.close(); say("ended: log in again", "bad"); });
    es.onerror = () => say(es.readyState === EventSource.CLOSED ? "closed" : "reconnecting…", "bad");
  }

  document.addEventListener("DOMContentLoaded", () => {
    const overview = document.getElementById("readiness");
    if (overview && overview.dataset.refresh) startOverview(overview);
    const exec = document.getElementById("exec-form");
    if (exec) startExec(exec);
    const tail = document.getElementById("tail");
    if (tail && tail.dataset.stream) startTail(tail);
  });
})();
