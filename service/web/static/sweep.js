/* ddpq dashboard: one sweep's page (/sweeps/<id>) — facts and counts, the trials table
 * (sortable by any column, the objective's best row highlighted, states live), the chosen
 * metric's curves of every trial overlaid (downsampled per trial by the API, one call for
 * all trials) and a scatter of the objective against each axis. */
"use strict";

(function () {
  const d = window.ddpq;
  const o = window.ddpqOverlay;
  const s = window.ddpqSweeps;
  const sweepId = Number(document.body.dataset.sweepId);
  const base = "sweeps/" + sweepId;
  const POINT_BUDGET = 20000; // points of all curves together
  const CURVE_EVERY_TICKS = 5; // curves refresh every 5th poll (10 s) while trials run
  const BEST_COLOR = "#b3261e";
  const COMPARE_BEST = 5; // trials the "Compare the best" link opens
  const $ = (id) => document.getElementById(id);

  const view = {
    sweep: null,
    trials: [],
    sort: { key: "position", dir: 1 },
    metric: null,
    names: [],
    curves: [],
    ticks: 0,
    scatterKey: null,
  };

  /* ---------- helpers over trials ---------- */

  function axisPaths() {
    const spec = (view.sweep && view.sweep.spec) || {};
    const paths = Object.keys(spec.axes || {});
    for (const t of view.trials) for (const p of Object.keys(t.overrides || {})) if (!paths.includes(p)) paths.push(p);
    return paths;
  }

  function isBest(t) {
    const best = view.sweep && view.sweep.best;
    return Boolean(best) && t.key === best.trial_key;
  }

  /* Trial key → 0 (worst) … 1 (best) by objective value; trials without one, or that
     cannot be best (the API's `may_be_best`, the rule of its `best`), are absent. */
  function objectiveRanks() {
    const mode = (view.sweep && view.sweep.objective && view.sweep.objective.mode) || "min";
    const scored = view.trials.filter((t) => t.objective_value !== null && t.objective_value !== undefined && t.may_be_best);
    scored.sort((a, b) => (mode === "max" ? a.objective_value - b.objective_value : b.objective_value - a.objective_value));
    const ranks = new Map();
    scored.forEach((t, i) => ranks.set(t.key, scored.length > 1 ? i / (scored.length - 1) : 1));
    return ranks;
  }

  function trialLabel(t) {
    const parts = Object.entries(t.overrides || {}).map(([k, v]) => k.split(".").pop() + "=" + s.valueText(v));
    return "#" + t.job_id + (parts.length ? " (" + parts.join(", ") + ")" : "");
  }

  /* ---------- header and facts ---------- */

  function renderSweep(sweep) {
    document.title = sweep.name + " · sweep " + sweep.id + " · ddpq";
    d.setText("sweep-name", sweep.name);
    d.setBadge($("sweep-state"), sweep.state);
    const counts = $("sweep-counts");
    d.clear(counts);
    counts.append(s.countBadges(sweep.counts));
    d.setText("f-owner", sweep.owner);
    d.setText("f-objective", s.objectiveText(sweep.objective));
    const running = sweep.best && sweep.best.outcome === "running" ? ", still running" : "";
    d.setText("f-best", sweep.best ? d.fmtValue(sweep.best.value) + " (job #" + sweep.best.job_id + running + ")" : "–");
    d.setText("f-trials", String(sweep.trials_total));
    d.setText("f-max-concurrent", sweep.max_concurrent === null ? "no limit" : String(sweep.max_concurrent));
    d.setText("f-max-failed", sweep.max_failed === null ? "no limit" : String(sweep.max_failed));
    d.setText("f-created", d.fmtTime(sweep.created_at));
    d.setText("f-finished", d.fmtTime(sweep.finished_at));
    const reason = $("stop-reason");
    reason.hidden = !sweep.stop_reason;
    if (sweep.stop_reason) d.setText(reason, "Stopped: " + sweep.stop_reason);
  }

  /* ---------- the trials table ---------- */

  function columns() {
    const cols = [
      { key: "position", label: "Trial", value: (t) => t.position, cell: (t) => d.el("td", { class: "num" }, t.position) },
      {
        key: "job",
        label: "Job",
        value: (t) => t.job_id,
        cell: (t) => d.el("td", { class: "num" }, t.job_id ? d.el("a", { href: "/jobs/" + t.job_id }, "#" + t.job_id) : "–"),
      },
      { key: "outcome", label: "Outcome", value: (t) => t.outcome, cell: (t) => d.el("td", null, d.badge(t.outcome)) },
    ];
    for (const path of axisPaths()) {
      cols.push({
        key: "axis:" + path,
        label: path,
        value: (t) => (t.overrides || {})[path],
        cell: (t) => d.el("td", { class: "num mono", "data-axis": path }, s.valueText((t.overrides || {})[path])),
      });
    }
    const metric = (view.sweep && view.sweep.objective && view.sweep.objective.metric) || "objective";
    cols.push(
      {
        key: "objective",
        label: metric,
        value: (t) => t.objective_value,
        cell: (t) => d.el("td", { class: "num objective" }, t.objective_value === null ? "–" : d.fmtValue(t.objective_value)),
      },
      { key: "steps", label: "Steps", value: (t) => t.steps_done, cell: (t) => d.el("td", { class: "num" }, t.steps_done === null ? "–" : t.steps_done) },
      { key: "attempts", label: "Jobs", value: (t) => t.attempts, cell: (t) => d.el("td", { class: "num opt" }, t.attempts) },
      { key: "run_time", label: "Run time", value: (t) => t.run_time_s, cell: (t) => d.el("td", { class: "num opt" }, d.fmtDuration(t.run_time_s)) },
    );
    return cols;
  }

  /* Ascending order of two cell values; missing values go last whatever the direction. */
  function compare(a, b, dir) {
    const missingA = a === null || a === undefined;
    const missingB = b === null || b === undefined;
    if (missingA || missingB) return missingA === missingB ? 0 : missingA ? 1 : -1;
    if (typeof a === "number" && typeof b === "number") return dir * (a - b);
    return dir * String(a).localeCompare(String(b), undefined, { numeric: true });
  }

  function renderHead(head, cols, headKey) {
    view.headKey = headKey;
    const active = document.activeElement;
    const focused = active && head.contains(active) ? active.closest("th").dataset.key : null;
    d.clear(head);
    for (const col of cols) {
      const sorted = view.sort.key === col.key;
      const th = d.el(
        "th",
        { "data-key": col.key, "aria-sort": sorted ? (view.sort.dir > 0 ? "ascending" : "descending") : "none" },
        d.el("button", { type: "button", class: "sort", title: "Sort by " + col.label }, col.label),
      );
      if (["attempts", "run_time"].includes(col.key)) th.classList.add("opt");
      head.append(th);
    }
    if (focused) {
      const again = head.querySelector('th[data-key="' + CSS.escape(focused) + '"] button');
      if (again) again.focus();
    }
  }

  function renderTrials() {
    const cols = columns();
    const head = $("trials-head");
    // The header is rebuilt only when its columns or the sort change, so a focused header
    // button keeps its focus across polls (and across its own click).
    const headKey = JSON.stringify([cols.map((c) => c.key), view.sort]);
    if (headKey !== view.headKey) renderHead(head, cols, headKey);
    const col = cols.find((c) => c.key === view.sort.key) || cols[0];
    const rows = view.trials.slice();
    rows.sort((a, b) => compare(col.value(a), col.value(b), view.sort.dir) || a.position - b.position);
    const body = $("trials-body");
    d.clear(body);
    for (const t of rows) {
      const tr = d.el("tr", { "data-key": t.key, "data-job-id": t.job_id, "data-outcome": t.outcome });
      if (isBest(t)) {
        tr.classList.add("best");
        tr.title = "The best trial by the sweep's objective";
      }
      for (const c of cols) tr.append(c.cell(t));
      body.append(tr);
    }
  }

  /* "Compare the best N": the compare page with the best trials by objective (up to 5). */
  function renderCompareLink() {
    const ranks = objectiveRanks();
    const best = view.trials
      .filter((t) => ranks.has(t.key) && t.job_id)
      .sort((a, b) => ranks.get(b.key) - ranks.get(a.key))
      .slice(0, COMPARE_BEST);
    const link = $("compare-best");
    link.hidden = best.length < 2;
    link.href = "/compare?jobs=" + best.map((t) => t.job_id).join(",");
    d.setText(link, "Compare the best " + best.length);
  }

  $("trials-head").addEventListener("click", (ev) => {
    const th = ev.target instanceof Element ? ev.target.closest("th[data-key]") : null;
    if (!th) return;
    const key = th.dataset.key;
    view.sort = { key: key, dir: view.sort.key === key ? -view.sort.dir : 1 };
    renderTrials();
  });

  /* ---------- curves of all trials ---------- */

  const curves = o.overlayChart($("curves-plot"), $("curves-readout"), "step");

  /* Draw the held curves; skipped when nothing drawn would change (a redraw resets zoom). */
  function drawCurves(force) {
    const ranks = objectiveRanks();
    const key = JSON.stringify([view.metric, $("log-scale").checked, view.sweep && view.sweep.best, [...ranks]]);
    if (force !== true && key === view.drawnKey) return;
    view.drawnKey = key;
    const byJob = new Map(view.trials.map((t) => [t.job_id, t]));
    const runs = [];
    let best = null;
    for (const series of view.curves) {
      const t = byJob.get(series.job_id) || { key: series.trial_key, job_id: series.job_id, overrides: {} };
      const run = {
        id: series.job_id,
        label: trialLabel(t),
        color: ranks.has(t.key) ? o.rankColor(ranks.get(t.key)) : "#c4cad4",
        points: series.points,
      };
      if (isBest(t)) best = Object.assign(run, { color: BEST_COLOR, width: 3 });
      else runs.push(run);
    }
    if (best) runs.push(best); // drawn last: on top
    curves.draw(runs, { logScale: $("log-scale").checked });
    $("curves-empty").hidden = runs.length > 0;
    $("curves-sampled").hidden = !view.curves.some((series) => series.sampled);
    $("curves-plot").dataset.metric = view.metric || "";
    $("curves-plot").dataset.best = best ? String(best.id) : "";
  }

  async function loadNames() {
    const res = await d.api(base + "/metrics/names");
    const names = res.body.names || [];
    const objective = view.sweep.objective && view.sweep.objective.metric;
    if (objective && !names.includes(objective)) names.unshift(objective);
    const select = $("metric-name");
    if (names.join("\n") !== view.names.join("\n")) {
      view.names = names;
      d.clear(select);
      for (const name of names) select.append(d.el("option", { value: name }, name));
    }
    if (!view.metric) view.metric = objective || names[0] || "loss";
    select.value = view.metric;
  }

  async function loadCurves() {
    const perTrial = Math.max(50, Math.min(1000, Math.floor(POINT_BUDGET / Math.max(1, view.trials.length))));
    const q = new URLSearchParams({ name: view.metric, max_points: String(perTrial) });
    const res = await d.api(base + "/metrics?" + q.toString());
    view.curves = res.body.series || [];
    drawCurves(true);
  }

  $("metric-name").addEventListener("change", async (ev) => {
    view.metric = ev.target.value;
    try {
      await loadCurves();
    } catch (err) {
      d.showBanner("Could not load " + view.metric + ": " + err.message, "error");
    }
  });
  $("log-scale").addEventListener("change", () => drawCurves(true));

  /* ---------- objective against each axis ---------- */

  function renderScatters() {
    const scored = view.trials.filter((t) => t.objective_value !== null && t.objective_value !== undefined);
    const key = JSON.stringify([view.sweep.best, scored.map((t) => [t.key, t.objective_value])]);
    if (key === view.scatterKey) return;
    view.scatterKey = key;
    const box = $("scatters");
    d.clear(box);
    $("scatters-empty").hidden = scored.length > 0;
    if (!scored.length) return;
    const axes = (view.sweep.spec && view.sweep.spec.axes) || {};
    const metric = view.sweep.objective.metric;
    for (const path of axisPaths()) {
      if (path === "training.seed" && !(path in axes)) continue; // replicas, not an axis
      const values = scored.map((t) => (t.overrides || {})[path]);
      const numeric = values.every((v) => typeof v === "number");
      const categories = numeric ? null : [...new Set(values.map(s.valueText))].sort();
      const positive = numeric && values.every((v) => v > 0);
      const logX = positive && ("loguniform" in (axes[path] || {}) || Math.max(...values) / Math.min(...values) >= 100);
      const points = scored.map((t, i) => ({
        x: numeric ? values[i] : categories.indexOf(s.valueText(values[i])),
        y: t.objective_value,
        best: isBest(t),
        label: trialLabel(t),
      }));
      const readout = d.el("p", { class: "readout muted" }, "\u00a0");
      const plot = d.el("div", { class: "plot" });
      box.append(d.el("div", { class: "chart scatter", "data-axis": path }, d.el("h3", null, metric + " vs " + path), plot, readout));
      o.scatterChart(plot, readout).draw(points, { xLabel: path, yLabel: metric, categories: categories, logX: logX });
    }
  }

  /* ---------- the poll loop ---------- */

  async function tick() {
    view.ticks += 1;
    let sweep;
    try {
      sweep = (await d.api(base)).body;
    } catch (err) {
      if (err.status === 404) {
        $("not-found").hidden = false;
        $("sweep-body").hidden = true; // nothing of a sweep that is not there (or not yours)
        poller.stop();
        return false;
      }
      throw err;
    }
    view.sweep = sweep;
    view.trials = (await d.api(base + "/trials")).body.trials || [];
    renderSweep(sweep);
    renderTrials();
    renderCompareLink();
    renderScatters();
    const live = s.SWEEP_LIVE.includes(sweep.state) || view.trials.some((t) => d.LIVE_STATES.includes(t.outcome));
    if (view.ticks === 1 || (live && view.ticks % CURVE_EVERY_TICKS === 0)) {
      await loadNames();
      await loadCurves();
    } else {
      drawCurves(); // colours follow the objective ranks
    }
    d.setText("poll-status", live ? "Live: refreshing every 2 s." : "Finished.");
    document.body.dataset.loaded = "1";
    return live;
  }

  const poller = new d.Poller(tick, 2000, 30000);
  poller.start();
})();
