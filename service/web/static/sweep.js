/* ddpq dashboard: one sweep's page (/sweeps/<id>) — facts and counts, the trials table (a
 * page at a time, sorted on the server: sweep_trials.js), the chosen metric's curves overlaid
 * (every trial's in a small sweep; in a large one the best BEST_CURVES by the objective plus
 * the trials the user ticks) and a scatter of the objective against each axis.
 * The page stays usable at 10,000 trials: the first load reads the best TOP_LIMIT trials
 * (enough for the colours, the best curves and the scatters) and one page of the table;
 * each poll then reads the sweep (counts, best) and only the trials whose job changed since
 * the previous answer (?changed_since=, an overlapping window: rows are deduped by key). */
"use strict";

(function () {
  const d = window.ddpq;
  const o = window.ddpqOverlay;
  const s = window.ddpqSweeps;
  const sweepId = Number(document.body.dataset.sweepId);
  const base = "sweeps/" + sweepId;
  const POINT_BUDGET = 20000; // points of all curves together (a small sweep's)
  const CURVE_EVERY_TICKS = 5; // curves refresh every 5th poll (10 s) while trials run
  const ALL_CURVES_UP_TO = 100; // sweeps this small draw every trial's curve
  const BEST_CURVES = 10; // larger ones the best this many, plus the ticked trials
  const PICKED_POINTS = 300; // points per curve then
  const REFRESH_AT_ONCE = 2; // changed curves fetched again per refresh (a poll's bytes)
  const TOP_LIMIT = 500; // best trials read on the first load (the API's page limit)
  const BEST_COLOR = "#b3261e";
  const COMPARE_BEST = 5; // trials the "Compare the best" link opens
  const $ = (id) => document.getElementById(id);

  const view = {
    sweep: null,
    held: new Map(), // trial key → its newest row from any answer (best, page, deltas)
    topComplete: false, // the first load read every trial (none left past TOP_LIMIT)
    changedSince: null,
    changedJobs: new Set(), // jobs a delta brought since their curves were read
    picked: new Set(), // job ids whose curves the user ticked
    metric: null,
    names: [],
    curves: [],
    curveMetric: null, // the metric and the job ids (null: all) of the curves held
    curveJobs: null,
    ticks: 0,
    scatterKey: null,
  };

  /* ---------- helpers over trials ---------- */

  function trials() {
    return [...view.held.values()];
  }

  function hold(rows) {
    for (const t of rows) view.held.set(t.key, t);
  }

  function axisPaths() {
    const spec = (view.sweep && view.sweep.spec) || {};
    const paths = Object.keys(spec.axes || {});
    for (const t of view.held.values()) for (const p of Object.keys(t.overrides || {})) if (!paths.includes(p)) paths.push(p);
    return paths;
  }

  function isBest(t) {
    const best = view.sweep && view.sweep.best;
    return Boolean(best) && t.key === best.trial_key;
  }

  /* Trial key → 0 (worst) … 1 (best) by objective value among the held trials; trials
     without one, or that cannot be best (the API's `may_be_best`, the rule of its `best`),
     are absent. */
  function objectiveRanks() {
    const mode = (view.sweep && view.sweep.objective && view.sweep.objective.mode) || "min";
    const scored = trials().filter((t) => t.objective_value !== null && t.objective_value !== undefined && t.may_be_best);
    scored.sort((a, b) => (mode === "max" ? a.objective_value - b.objective_value : b.objective_value - a.objective_value));
    const ranks = new Map();
    scored.forEach((t, i) => ranks.set(t.key, scored.length > 1 ? i / (scored.length - 1) : 1));
    return ranks;
  }

  /* Job ids of the best ``n`` trials by objective (best first). */
  function bestJobs(n) {
    const ranks = objectiveRanks();
    return trials()
      .filter((t) => ranks.has(t.key) && t.job_id)
      .sort((a, b) => ranks.get(b.key) - ranks.get(a.key))
      .slice(0, n)
      .map((t) => t.job_id);
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

  /* "Compare the best N": the compare page with the best trials by objective (up to 5). */
  function renderCompareLink() {
    const best = bestJobs(COMPARE_BEST);
    const link = $("compare-best");
    link.hidden = best.length < 2;
    link.href = "/compare?jobs=" + best.join(",");
    d.setText(link, "Compare the best " + best.length);
  }

  /* ---------- the trials: the best on first load, then only what changed ---------- */

  const table = window.ddpqSweepTrials.trialsTable({
    base: base,
    sweep: () => view.sweep,
    axisPaths: axisPaths,
    isBest: isBest,
    held: (key) => view.held.get(key),
    picked: view.picked,
    onRows: hold,
    onPick: () => refreshCurves().catch((err) => d.showBanner("Could not load curves: " + err.message, "error")),
  });

  async function loadBest() {
    const mode = (view.sweep.objective && view.sweep.objective.mode) || "min";
    const q = new URLSearchParams({ sort: "objective_value", order: mode === "max" ? "desc" : "asc", limit: String(TOP_LIMIT) });
    const body = (await d.api(base + "/trials?" + q.toString())).body;
    hold(body.trials || []);
    view.topComplete = body.next_offset === null;
    view.changedSince = body.changed_since;
  }

  /* The trials whose job changed since the previous answer (held, newest wins), and the
   * rows held of them before (trial key → row). */
  async function loadChanged() {
    const q = new URLSearchParams({ changed_since: view.changedSince });
    const body = (await d.api(base + "/trials?" + q.toString())).body;
    const rows = body.trials || [];
    const before = new Map(rows.filter((t) => view.held.has(t.key)).map((t) => [t.key, view.held.get(t.key)]));
    hold(rows);
    view.changedSince = body.changed_since;
    for (const t of rows) if (t.job_id) view.changedJobs.add(t.job_id);
    return { rows: rows, before: before };
  }

  /* ---------- curves: every trial's, or the best and the ticked ones ---------- */

  const curves = o.overlayChart($("curves-plot"), $("curves-readout"), "step");

  /* Draw the held curves; skipped when nothing drawn would change (a redraw resets zoom). */
  function drawCurves(force) {
    const ranks = objectiveRanks();
    const key = JSON.stringify([view.metric, $("log-scale").checked, view.sweep && view.sweep.best, [...ranks]]);
    if (force !== true && key === view.drawnKey) return;
    view.drawnKey = key;
    const byJob = new Map(trials().map((t) => [t.job_id, t]));
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

  /* Job ids whose curves are drawn: null (every trial's) in a small sweep, else the best
   * BEST_CURVES by objective and the ticked ones. */
  function curveJobs() {
    if (view.sweep.trials_total <= ALL_CURVES_UP_TO) return null;
    return [...new Set([...bestJobs(BEST_CURVES), ...view.picked])];
  }

  async function fetchCurves(ids, perTrial) {
    const q = new URLSearchParams({ name: view.metric, max_points: String(perTrial) });
    for (const id of ids || []) q.append("job_id", String(id));
    return (await d.api(base + "/metrics?" + q.toString())).body.series || [];
  }

  /* Read the curves again. A small sweep, or another metric: all of them. Else only the
   * curves of trials that joined the set drawn (a new best, a tick) and a few of those whose
   * job changed since they were read, so a poll's bytes stay bounded. */
  async function refreshCurves() {
    const ids = curveJobs();
    if (ids === null || view.metric !== view.curveMetric) {
      const count = ids === null ? view.sweep.trials_total : ids.length;
      const perTrial = ids === null ? Math.max(50, Math.min(1000, Math.floor(POINT_BUDGET / Math.max(1, count)))) : PICKED_POINTS;
      view.curves = ids !== null && !ids.length ? [] : await fetchCurves(ids, perTrial);
      view.changedJobs.clear();
    } else {
      const held = new Set(view.curveJobs || []);
      const joined = ids.filter((id) => !held.has(id));
      const stale = ids.filter((id) => held.has(id) && view.changedJobs.has(id)).slice(0, REFRESH_AT_ONCE);
      const read = [...joined, ...stale];
      const fresh = new Map((read.length ? await fetchCurves(read, PICKED_POINTS) : []).map((c) => [c.job_id, c]));
      for (const id of read) view.changedJobs.delete(id);
      const wanted = new Set(ids);
      view.curves = view.curves.filter((c) => wanted.has(c.job_id) && !read.includes(c.job_id)).concat([...fresh.values()]);
      if (!read.length && ids.length === held.size) return drawCurves();
    }
    view.curveMetric = view.metric;
    view.curveJobs = ids;
    $("curves-title").textContent =
      ids === null ? "Curves of all trials" : "Curves of the best " + BEST_CURVES + " trials and the ones ticked below";
    $("curves-plot").dataset.jobs = ids === null ? "all" : ids.join(",");
    drawCurves(true);
  }

  $("metric-name").addEventListener("change", async (ev) => {
    view.metric = ev.target.value;
    try {
      await refreshCurves();
    } catch (err) {
      d.showBanner("Could not load " + view.metric + ": " + err.message, "error");
    }
  });
  $("log-scale").addEventListener("change", () => drawCurves(true));

  /* ---------- objective against each axis ---------- */

  function renderScatters() {
    const scored = trials().filter((t) => t.objective_value !== null && t.objective_value !== undefined);
    const key = JSON.stringify([view.sweep.best, scored.map((t) => [t.key, t.objective_value])]);
    if (key === view.scatterKey) return;
    view.scatterKey = key;
    const partial = $("scatters-partial");
    partial.hidden = view.topComplete;
    d.setText(partial, "The best " + scored.length + " of " + view.sweep.trials_total + " trials by the objective (and those that changed since the page opened).");
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
    renderSweep(sweep);
    if (view.changedSince === null) {
      // The first load (or a retry of one that failed): the best trials, then a page.
      await loadBest();
      await table.load();
    } else {
      const changed = await loadChanged();
      await table.update(changed.rows, changed.before, sweep.trials_total);
    }
    renderCompareLink();
    renderScatters();
    const live = s.SWEEP_LIVE.includes(sweep.state) || d.LIVE_STATES.some((state) => (sweep.counts || {})[state] > 0);
    if (view.ticks === 1 || (live && view.ticks % CURVE_EVERY_TICKS === 0)) {
      await loadNames();
      await refreshCurves();
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
