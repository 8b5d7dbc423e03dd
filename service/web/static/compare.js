/* ddpq dashboard: the compare page (/compare?jobs=1,2,3) — the jobs side by side: one chart
 * per metric with every job's curve overlaid (downsampled by the API), and a table of only
 * the spec fields whose values differ (specs flattened to dotted paths). Polls while a job
 * is live. A job the caller may not see is "not found", like on its own page. */
"use strict";

(function () {
  const d = window.ddpq;
  const o = window.ddpqOverlay;
  const MAX_JOBS = 12;
  const MAX_POINTS = 1000; // per job and metric
  const $ = (id) => document.getElementById(id);

  const ids = [];
  for (const part of (new URLSearchParams(window.location.search).get("jobs") || "").split(",")) {
    const id = Number(part.trim());
    if (Number.isSafeInteger(id) && id > 0 && !ids.includes(id)) ids.push(id);
  }

  const view = { jobs: [], missing: [], specKey: null, names: [], charts: new Map(), ticks: 0 };

  function color(job) {
    return o.paletteColor(ids.indexOf(job.id));
  }

  function label(job) {
    return "#" + job.id + " " + job.name;
  }

  function renderLegend() {
    const list = $("compare-legend");
    d.clear(list);
    for (const job of view.jobs) {
      const swatch = d.el("span", { class: "swatch" });
      swatch.style.background = color(job);
      list.append(
        d.el(
          "li",
          { "data-job-id": job.id },
          swatch,
          d.el("a", { href: "/jobs/" + job.id }, label(job)),
          " ",
          d.badge(job.state),
        ),
      );
    }
  }

  /* Rows of the spec fields whose values differ between the jobs (missing counts as a value). */
  function renderDiff() {
    const key = view.jobs.map((j) => j.id).join(",");
    if (key === view.specKey) return;
    view.specKey = key;
    const flat = view.jobs.map((job) => o.flatten(job.spec || {}, "", {}));
    const paths = [...new Set(flat.flatMap((f) => Object.keys(f)))].sort();
    const head = $("diff-head");
    d.clear(head);
    head.append(d.el("th", null, "Field"));
    for (const job of view.jobs) head.append(d.el("th", { "data-job-id": job.id }, "#" + job.id));
    const body = $("diff-body");
    d.clear(body);
    let rows = 0;
    for (const path of paths) {
      const values = flat.map((f) => (path in f ? f[path] : undefined));
      if (values.every((v) => v === values[0])) continue;
      rows += 1;
      const tr = d.el("tr", { "data-path": path }, d.el("td", { class: "mono" }, path));
      for (const v of values) tr.append(d.el("td", { class: "mono" }, v === undefined ? "–" : v));
      body.append(tr);
    }
    $("diff-table").hidden = rows === 0;
    $("diff-same").hidden = rows > 0;
  }

  function chartFor(name) {
    let c = view.charts.get(name);
    if (c) return c;
    const readout = d.el("p", { class: "readout muted" }, "\u00a0");
    const plot = d.el("div", { class: "plot" });
    const node = d.el("div", { class: "chart", "data-metric": name }, d.el("h3", null, name), plot, readout);
    if (name === "loss") $("compare-charts").prepend(node);
    else $("compare-charts").append(node);
    c = { chart: o.overlayChart(plot, readout, "step"), runs: [] };
    view.charts.set(name, c);
    $("compare-charts-empty").hidden = true;
    return c;
  }

  async function loadNames() {
    const perJob = await Promise.all(
      view.jobs.map((job) => d.api("jobs/" + job.id + "/metrics/names").then((r) => r.body.names || [])),
    );
    view.namesByJob = new Map(view.jobs.map((job, i) => [job.id, perJob[i]]));
    const names = [...new Set(perJob.flat())];
    names.sort((a, b) => (a === "loss" ? -1 : b === "loss" ? 1 : a.localeCompare(b)));
    view.names = names;
  }

  async function loadCurves() {
    const logScale = $("log-scale").checked;
    for (const name of view.names) {
      const jobs = view.jobs.filter((job) => view.namesByJob.get(job.id).includes(name));
      const bodies = await Promise.all(
        jobs.map((job) =>
          d.api("jobs/" + job.id + "/metrics?" + new URLSearchParams({ name: name, max_points: String(MAX_POINTS) })),
        ),
      );
      const c = chartFor(name);
      c.runs = jobs.map((job, i) => ({
        id: job.id,
        label: label(job),
        color: color(job),
        points: (bodies[i].body.points || []).map((p) => [p.step, p.value]),
      }));
      c.chart.draw(c.runs, { logScale: logScale });
    }
  }

  function redraw() {
    const logScale = $("log-scale").checked;
    for (const c of view.charts.values()) c.chart.draw(c.runs, { logScale: logScale });
  }

  async function fetchJob(id) {
    try {
      return (await d.api("jobs/" + id)).body;
    } catch (err) {
      if (err.status === 404) return null;
      throw err;
    }
  }

  async function tick() {
    view.ticks += 1;
    const found = await Promise.all(ids.map(fetchJob));
    view.jobs = found.filter(Boolean);
    view.missing = ids.filter((_, i) => !found[i]);
    const missing = $("compare-missing");
    missing.hidden = !view.missing.length;
    if (view.missing.length) {
      d.setText(missing, "Not found: " + view.missing.map((id) => "job " + id).join(", ") + ".");
    }
    $("compare-body").hidden = !view.jobs.length;
    renderLegend();
    renderDiff();
    const live = view.jobs.some((job) => d.LIVE_STATES.includes(job.state));
    if (view.ticks === 1 || live) {
      await loadNames();
      await loadCurves();
    }
    document.body.dataset.loaded = "1";
    return live;
  }

  $("log-scale").addEventListener("change", redraw);
  if (ids.length > MAX_JOBS) {
    $("compare-capped").hidden = false;
    d.setText("compare-capped", "Comparing the first " + MAX_JOBS + " of the " + ids.length + " jobs asked for.");
    ids.length = MAX_JOBS;
  }
  if (!ids.length) {
    $("compare-empty").hidden = false;
    document.body.dataset.loaded = "1";
  } else {
    new d.Poller(tick, 5000, 30000).start();
  }
})();
