// The verl dashboard page: live (polling the server's /api) or a report (data embedded in the page).
(() => {
  "use strict";
  const BOOT = window.VERL_BOOT || { live: false, interval_ms: 0 };
  const embedded = document.getElementById("verl-data");
  const REPORT = embedded ? JSON.parse(embedded.textContent) : null;
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
  // Charts by section; metrics in no section land in "Other metrics".
  const SECTIONS = [
    ["Reward", ["reward/mean", "val/reward_mean", "env/reward_mean", "reward/flat_group_frac"]],
    ["KL", ["ppo/kl_divergence", "actor/ref_kl", "ppo/approx_kl"]],
    ["Losses", ["ppo/actor_loss", "ppo/pg_loss", "ppo/kl_loss", "critic/value_loss"]],
    ["Entropy and response length", ["ppo/entropy", "response_length/mean", "response_length/clip_frac"]],
    ["Throughput and memory", ["throughput/tokens_per_sec", "throughput/samples_per_sec", "memory/actor_peak_gb"]],
    ["Timings per stage (s)", ["timing/step", "timing/generate", "timing/old_log_probs", "timing/ref_log_probs",
      "timing/update_actor", "timing/sync_weights", "timing/reward", "timing/validation"]],
  ];
  const state = { runs: [], metrics: {}, hidden: new Set(), charts: {}, samples: {}, refreshes: 0 };
  const $ = (sel) => document.querySelector(sel);
  const el = (tag, attrs = {}, ...children) => {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "class") node.className = v; else if (k === "text") node.textContent = v; else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c);
    return node;
  };
  const fmt = (v) => (typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toPrecision(4)) : String(v));
  const when = (t) => (t ? new Date(t * 1000).toLocaleString() : "—");
  const colorOf = (id) => COLORS[state.runs.findIndex((r) => r.id === id) % COLORS.length];
  const runById = (id) => state.runs.find((r) => r.id === id);

  // ------------------------------------------------------------------ data
  const api = {
    async runs() {
      if (REPORT) return REPORT.runs;
      return (await (await fetch("/api/runs", { cache: "no-store" })).json()).runs;
    },
    async metrics(id, from, epoch) {
      if (REPORT) {
        const run = REPORT.runs.find((r) => r.id === id);
        return { epoch: run.metrics_epoch, start: 0, rows: from ? [] : run.metrics, total: run.metrics.length };
      }
      const q = new URLSearchParams({ run: id, from: String(from) });
      if (epoch !== null) q.set("epoch", String(epoch));
      return (await fetch(`/api/metrics?${q}`, { cache: "no-store" })).json();
    },
    async samples(id, file) {
      if (REPORT) return (REPORT.runs.find((r) => r.id === id).samples || {})[file] || [];
      const q = new URLSearchParams({ run: id, file });
      return (await (await fetch(`/api/samples?${q}`, { cache: "no-store" })).json()).samples || [];
    },
  };

  async function refresh() {
    state.runs = await api.runs();
    let changed = false;
    for (const run of state.runs) {
      const m = state.metrics[run.id] || (state.metrics[run.id] = { epoch: null, rows: [] });
      const got = await api.metrics(run.id, m.rows.length, m.epoch);
      if (got.start !== m.rows.length) { m.rows = m.rows.slice(0, got.start); changed = true; }
      if (got.rows.length) { m.rows.push(...got.rows); changed = true; }
      m.epoch = got.epoch;
    }
    renderLegend();
    renderHealth();
    if (changed || !state.drawn) { renderCharts(); state.drawn = true; }
    renderRuns();
    renderConfig();
    await renderSamples(false);
    state.refreshes += 1;
    document.body.dataset.refreshes = String(state.refreshes);
    $("#updated").textContent = REPORT ? `report of ${when(REPORT.generated)}`
      : `live · updated ${new Date().toLocaleTimeString()}`;
  }

  // ------------------------------------------------------------------ header
  function renderLegend() {
    const box = $("#legend");
    box.replaceChildren(...state.runs.map((run) => {
      const box = el("input", { type: "checkbox", "data-run": run.id });
      box.checked = !state.hidden.has(run.id);
      box.addEventListener("change", () => {
        if (box.checked) state.hidden.delete(run.id); else state.hidden.add(run.id);
        renderCharts();
      });
      const status = run.status.status;
      return el("label", {}, box, el("span", { class: "swatch", style: `background:${colorOf(run.id)}` }),
        `${run.id} `, el("span", { class: `badge ${status}`, text: status }));
    }));
  }

  function renderHealth() {
    const lines = [];
    for (const run of state.runs) {
      for (const h of run.health) lines.push(el("div", { class: "warning", "data-check": h.check,
        text: `⚠ ${run.id}, step ${h.step} (${h.check}): ${h.message}` }));
    }
    $("#health").replaceChildren(...lines);
  }

  // ------------------------------------------------------------------ charts
  function series(key) {
    // One x axis (steps) for every visible run that has the key (no legend row of a run without a point);
    // null where a run has no value at a step.
    const visible = [], perRun = [];
    for (const run of state.runs.filter((r) => !state.hidden.has(r.id))) {
      const byStep = new Map();
      for (const row of state.metrics[run.id].rows) {
        if (typeof row[key] === "number") byStep.set(row.step, row[key]);
      }
      if (byStep.size) { visible.push(run); perRun.push(byStep); }
    }
    const steps = [...new Set(perRun.flatMap((m) => [...m.keys()]))].sort((a, b) => a - b);
    const data = [steps, ...perRun.map((m) => steps.map((s) => (m.has(s) ? m.get(s) : null)))];
    const points = perRun.reduce((n, m) => n + m.size, 0);
    return { visible, data, points };
  }

  function metricKeys() {
    const keys = new Set();
    for (const run of state.runs) {
      for (const row of state.metrics[run.id].rows) {
        // data/* are the data set's counts, once at step 0: the runs table shows them, a chart would not.
        for (const [k, v] of Object.entries(row)) {
          if (k !== "step" && !k.startsWith("data/") && typeof v === "number") keys.add(k);
        }
      }
    }
    return keys;
  }

  function renderCharts() {
    const keys = metricKeys();
    $("#charts-empty").style.display = keys.size ? "none" : "";
    const placed = new Set(SECTIONS.flatMap(([, ks]) => ks));
    const sections = SECTIONS.map(([title, ks]) => [title, ks.filter((k) => keys.has(k))]);
    sections.push(["Other metrics", [...keys].filter((k) => !placed.has(k)).sort()]);
    const root = $("#charts");
    const wanted = new Set();
    for (const [title, ks] of sections) {
      if (!ks.length) continue;
      const id = `section-${title.replace(/\W+/g, "-").toLowerCase()}`;
      let grid = document.getElementById(id);
      if (!grid) {
        root.append(el("h2", { text: title, "data-section": id }));
        grid = el("div", { class: "grid", id });
        root.append(grid);
      }
      for (const key of ks) { wanted.add(key); drawChart(grid, key); }
    }
    for (const key of Object.keys(state.charts)) {
      if (!wanted.has(key)) { state.charts[key].plot.destroy(); state.charts[key].box.remove(); delete state.charts[key]; }
    }
  }

  // ------------------------------------------------------------------ axes
  // uPlot's defaults print 1e-6 as "0", give a flat series a range far from its value, put ticks at
  // step 2.5 and fill an idle legend with "--"; a learning-rate chart was unreadable.
  const STEP_INCRS = [1, 2, 5].flatMap((m) => [1, 10, 100, 1e3, 1e4, 1e5, 1e6].map((p) => m * p)).sort((a, b) => a - b);

  function decimals(x) {
    // Digits after the point in x written out (x >= 1e-6, where JavaScript still writes it out).
    const frac = String(+x.toPrecision(12)).split(".")[1];
    return frac ? frac.length : 0;
  }

  function number(v, step, top) {
    // One label in the scale of the ticks around it: 1e-6, 0.25, 12k.
    if (v === 0) return "0";
    if (top < 1e-3) {
      const digits = Math.max(0, Math.floor(Math.log10(top)) - Math.floor(Math.log10(step)));
      return v.toExponential(Math.min(digits, 6)).replace(/\.?0+e/, "e").replace("e+", "e");
    }
    if (top >= 1e4) {
      const [scale, unit] = top >= 1e9 ? [1e9, "G"] : top >= 1e6 ? [1e6, "M"] : [1e3, "k"];
      return (v / scale).toFixed(Math.min(decimals(step / scale), 6)) + unit;
    }
    return v.toFixed(Math.min(decimals(step), 8));
  }

  function yTicks(u, splits, axisIdx, space, incr) {
    const top = Math.max(...splits.map(Math.abs));
    return splits.map((v) => number(v, incr || top, top));
  }

  function yRange(u, min, max) {
    if (min == null || !Number.isFinite(min)) return [0, 1];
    if (max - min <= Math.abs(max) * 1e-9) {  // flat: a tenth of the value either side (0: -1..1)
      const pad = Math.abs(min) * 0.1 || 1;
      return [min - pad, max + pad];
    }
    return uPlot.rangeNum(min, max, 0.1, true);
  }

  const idleLegend = (u) => u.root.classList.toggle("idle", u.legend.idx == null);

  function legendValue(u, v) {
    // Hovered values at full precision in the same style as the ticks; idle rows are hidden (app.css).
    if (v == null) return "";
    return Number.isInteger(v) ? String(v) : number(v, Math.abs(v) / 1e3, Math.abs(v));
  }

  function drawChart(grid, key) {
    const { visible, data, points } = series(key);
    const signature = visible.map((r) => r.id).join(",");
    let chart = state.charts[key];
    if (!chart) {
      const box = el("div", { class: "chart", "data-key": key }, el("div", { class: "title", text: key }));
      grid.append(box);
      chart = state.charts[key] = { box, plot: null, signature: null };
    }
    chart.box.dataset.points = String(points);
    chart.box.dataset.runs = String(visible.length);
    if (chart.plot && chart.signature === signature) { chart.plot.setData(data); return; }
    if (chart.plot) chart.plot.destroy();
    const width = Math.max(300, chart.box.clientWidth - 12);
    chart.plot = new uPlot({
      width, height: 190,
      scales: { x: { time: false }, y: { range: yRange } },
      legend: { show: state.runs.length - state.hidden.size > 1 },
      series: [{ label: "step", value: legendValue }, ...visible.map((r) => ({
        label: r.id, stroke: colorOf(r.id), width: 1.5, spanGaps: true, points: { size: 4 }, value: legendValue,
      }))],
      axes: [{ label: "step", size: 36, incrs: STEP_INCRS, values: (u, splits) => splits.map(String) },
        { size: 56, values: yTicks }],
      hooks: {
        draw: [(u) => drawn(chart.box, u)],
        ready: [idleLegend], setLegend: [idleLegend],
      },
    }, data, chart.box);
    chart.signature = signature;
  }

  function drawn(box, u) {
    // What was drawn, for the browser tests (uPlot paints ticks on a canvas; _values are its labels).
    box.dataset.xTicks = (u.axes[0]._values || []).join("|");
    box.dataset.yTicks = (u.axes[1]._values || []).join("|");
    box.dataset.yRange = `${u.scales.y.min}|${u.scales.y.max}`;
  }

  window.addEventListener("resize", () => {
    for (const c of Object.values(state.charts)) c.plot && c.plot.setSize({ width: Math.max(300, c.box.clientWidth - 12), height: 190 });
  });

  // ------------------------------------------------------------------ samples
  function fillSelect(select, options) {
    const before = select.value;
    const values = options.map(([v]) => v);
    if (select.dataset.values === JSON.stringify(options)) return;
    select.replaceChildren(...options.map(([v, label]) => el("option", { value: v, text: label })));
    select.dataset.values = JSON.stringify(options);
    if (values.includes(before)) select.value = before;
  }

  async function renderSamples(force) {
    const runSel = $("#samples-run"), fileSel = $("#samples-file");
    fillSelect(runSel, state.runs.map((r) => [r.id, r.id]));
    const run = runById(runSel.value);
    if (!run) return;
    const files = run.sample_files;
    const options = files.map((f) => [f.file, f.split === "val" ? `validation @ step ${f.step}` : "training samples"]);
    const fresh = !fileSel.dataset.values;
    fillSelect(fileSel, options);
    if (fresh && files.length) {  // the latest validation first
      const vals = files.filter((f) => f.split === "val");
      if (vals.length) fileSel.value = vals[vals.length - 1].file;
    }
    const file = fileSel.value;
    if (!file) { $("#samples-table tbody").replaceChildren(); $("#samples-count").textContent = "no samples yet"; return; }
    const cacheKey = `${run.id}/${file}`;
    // A validation's file is written whole; the training samples grow, so they are read again while shown.
    const shown = $("#view-samples").classList.contains("active");
    if (force || !(cacheKey in state.samples) || (file === "train.jsonl" && !REPORT && shown)) {
      state.samples[cacheKey] = await api.samples(run.id, file);
    }
    showSamples(state.samples[cacheKey]);
  }

  function showSamples(all) {
    const mode = $("#samples-filter").value;
    const threshold = parseFloat($("#samples-threshold").value);
    const needle = $("#samples-search").value.trim().toLowerCase();
    let rows = all.slice();
    if (mode === "wrong") rows = rows.filter((s) => s.reward < threshold);
    if (mode === "longest") rows.sort((a, b) => b.response_tokens - a.response_tokens);
    if (mode === "lowest") rows.sort((a, b) => a.reward - b.reward);
    if (needle) {
      rows = rows.filter((s) => [s.prompt, s.response, s.ground_truth].some((v) => String(v ?? "").toLowerCase().includes(needle)));
    }
    const shown = rows.slice(0, 500);
    $("#samples-count").textContent = `${rows.length} of ${all.length} samples` + (rows.length > 500 ? " (first 500 shown)" : "");
    $("#samples-table").dataset.rows = String(rows.length);
    $("#samples-table tbody").replaceChildren(...shown.map((s) => {
      const response = el("td", { class: "text" }, s.response ?? "");
      if (s.transcript) response.append(transcript(s.transcript));
      return el("tr", { class: s.reward < threshold ? "wrong" : "right" },
        el("td", { text: fmt(s.step) }), el("td", { text: fmt(s.index) }),
        el("td", { class: "text", text: s.prompt ?? "" }), response,
        el("td", { class: "text", text: s.ground_truth === null || s.ground_truth === undefined ? "" : String(s.ground_truth) }),
        el("td", { class: "reward", text: fmt(s.reward) }), el("td", { text: fmt(s.response_tokens) }),
        el("td", { text: s.finish_reason ?? "" }));
    }));
  }

  function transcript(messages) {
    const box = el("details", { class: "transcript" }, el("summary", { text: `transcript (${messages.length} messages)` }));
    for (const m of messages) {
      const line = el("div", {}, el("span", { class: "role", text: `${m.role}: ` }), String(m.content ?? ""));
      if (m.tool_calls) line.append(el("code", { text: ` tool_calls ${JSON.stringify(m.tool_calls)}` }));
      box.append(line);
    }
    return box;
  }

  for (const id of ["#samples-run", "#samples-file"]) $(id).addEventListener("change", () => renderSamples(true));
  for (const id of ["#samples-filter", "#samples-threshold", "#samples-search"]) {
    $(id).addEventListener("input", () => renderSamples(false));
  }

  // ------------------------------------------------------------------ config
  function renderConfig() {
    const options = state.runs.map((r) => [r.id, r.id]);
    const a = $("#diff-a"), b = $("#diff-b"), shown = $("#config-run");
    const freshB = !b.dataset.values;
    fillSelect(a, options); fillSelect(b, options); fillSelect(shown, options);
    if (freshB && options.length > 1) b.value = options[1][0];
    const run = runById(shown.value);
    $("#config-text").textContent = run ? run.config_text || "(no config.toml)" : "";
    const ra = runById(a.value), rb = runById(b.value);
    $("#diff-a-head").textContent = ra ? ra.id : "A";
    $("#diff-b-head").textContent = rb ? rb.id : "B";
    if (!ra || !rb) return;
    const keys = [...new Set([...Object.keys(ra.config), ...Object.keys(rb.config)])].sort();
    const show = (v) => (v === undefined ? "(absent)" : JSON.stringify(v));
    const differing = keys.filter((k) => show(ra.config[k]) !== show(rb.config[k]));
    $("#diff-summary").textContent = ra === rb ? "pick two runs" : `${differing.length} of ${keys.length} keys differ`;
    $("#config-diff tbody").replaceChildren(...differing.map((k) => el("tr", { "data-key": k },
      el("td", { text: k }), el("td", { class: "changed", text: show(ra.config[k]) }),
      el("td", { class: "changed", text: show(rb.config[k]) }))));
  }
  for (const id of ["#diff-a", "#diff-b", "#config-run"]) $(id).addEventListener("change", renderConfig);

  // ------------------------------------------------------------------ runs
  function renderRuns() {
    $("#runs-table tbody").replaceChildren(...state.runs.map((run) => {
      const st = run.status;
      const status = el("td", {}, el("span", { class: `badge ${st.status}`, text: st.status }));
      if (st.error) status.append(el("div", { class: "error", text: st.error }));
      const ckpts = el("td", {}, ...(run.checkpoints.length ? run.checkpoints.map((c) => el("div", {
        "data-step": String(c.step),
        text: `step ${c.step}${c.latest ? " (latest)" : ""} · ${(c.bytes / 1e6).toFixed(1)} MB · ${when(c.time)}`,
      })) : ["none"]));
      const counts = {};
      for (const row of state.metrics[run.id].rows) {
        for (const [k, v] of Object.entries(row)) if (k.startsWith("data/") && v) counts[k.slice(5)] = v;
      }
      const data = el("td", { class: "data" }, ...Object.entries(counts).map(([k, v]) => el("div", { text: `${k}: ${fmt(v)}` })));
      const health = el("td", {}, ...(run.health.length ? run.health.map((h) => el("div", { text: `step ${h.step}: ${h.check}` })) : ["ok"]));
      return el("tr", { "data-run": run.id }, el("td", {}, el("span", { class: "swatch", style: `background:${colorOf(run.id)}` }), ` ${run.id}`),
        status, el("td", { text: `${st.step ?? 0} / ${st.max_steps ?? "?"}` }), el("td", { text: when(st.last_write) }),
        ckpts, health, data, el("td", { class: "text", text: run.path }));
    }));
  }

  // ------------------------------------------------------------------ views
  for (const button of document.querySelectorAll("nav button")) {
    button.addEventListener("click", () => {
      for (const b of document.querySelectorAll("nav button")) b.classList.toggle("active", b === button);
      for (const v of document.querySelectorAll(".view")) v.classList.toggle("active", v.id === `view-${button.dataset.view}`);
      if (button.dataset.view === "charts") window.dispatchEvent(new Event("resize"));
      if (button.dataset.view === "samples") renderSamples(false);
    });
  }

  async function loop() {
    try { await refresh(); } catch (err) { $("#updated").textContent = `update failed: ${err}`; }
    if (BOOT.live && BOOT.interval_ms > 0) setTimeout(loop, BOOT.interval_ms);
  }
  window.verlDashboard = { state, refresh };
  loop();
})();
