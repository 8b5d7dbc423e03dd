/* ddpq dashboard: a job's metric curves (one uPlot chart per metric name). The first load of a
 * series asks for a downsampled history (max_points); after that only steps after the last one
 * held are fetched (after_step). Values may be null (NaN) or "Infinity"/"-Infinity": they are
 * drawn as gaps. Each chart's element carries data-points and data-last-step.
 * The x axis is the step, the epoch (fractional: epochs done) or the wall time since the
 * series' first point; EMA smoothing is display only (the raw curve stays, faint). With no
 * point hovered the legend shows the newest point, not "--".
 * Restarts (setHistory, from the goodput ledger): on the step axis a dashed vertical line marks
 * where each attempt resumed, the earlier attempts' superseded points of those steps are drawn
 * dashed and grey, and points that are rank 0's own values (not the mean over ranks, e.g. the
 * flush after a rank failure) get a hollow red marker. A series whose every point is rank 0's
 * own (a job that does not average over ranks) is one curve, said so in its heading. Past
 * MAX_MARKED_POINTS points a series draws no markers (rank 0's points: a red line instead),
 * except on points no line shows (a curve of one point, e.g. an eval once per epoch): those
 * always get a filled marker.
 * Zooming into a step range (drag) fetches that range's own downsampled curve from the server
 * (re-bucketed, so the range's spikes show at any zoom) and merges it in (data-zoom: "lo-hi").
 * Each chart's element also carries data-resume-steps, data-superseded-points,
 * data-rank0-points and data-rank0-only; its plot holds the uPlot instance (ddpqChart). */
"use strict";

(function () {
  const d = window.ddpq;
  const FIRST_LOAD_MAX_POINTS = 2000; // downsample long histories on first load
  const PAGE_LIMIT = 1000; // points per incremental request
  const MAX_KEPT_POINTS = 20000; // past this, reload the series downsampled
  // Past this many points in a series its markers would hide the curve (and cost a draw
  // each): uPlot's own density rule still hides them sooner on a narrow chart.
  const MAX_MARKED_POINTS = 200;

  function markedPoints(values) {
    let n = 0;
    for (const v of values) if (v !== null && v !== undefined) n += 1;
    return n;
  }

  /* Charts of job ``base`` ("jobs/<id>") inside ``container``; ``emptyNote`` hides once a
   * metric exists. refresh(fetchNames) resolves to true when any series got new points. */
  function metricCharts(base, container, emptyNote) {
    const state = {
      series: new Map(),
      names: [],
      logScale: false,
      xMode: "step",
      smoothing: 0,
      // From the goodput ledger: where attempts resumed, and the step ranges they superseded.
      history: { resumes: [], lost: [] },
      historyKey: "",
    };

    // Charts follow their box's width (window resizes, a second chart joining the grid).
    const resizer =
      typeof ResizeObserver === "function"
        ? new ResizeObserver(() => {
            // Resize on the next frame, outside the observer's delivery (no resize loops).
            window.requestAnimationFrame(() => {
              for (const s of state.series.values()) {
                const width = Math.max(200, Math.floor(s.plot.clientWidth));
                if (s.chart && Math.abs(s.chart.width - width) > 1)
                  s.chart.setSize({ width: width, height: 220 });
              }
            });
          })
        : null;

    function plotValue(v) {
      const n = d.metricNumber(v);
      if (n === null || !Number.isFinite(n)) return null;
      if (state.logScale && n <= 0) return null;
      return n;
    }

    /* Epochs done at each point: epoch + the share of that epoch's steps before the point.
     * An epoch's length in steps is where the next epoch starts; the newest epoch borrows the
     * length of the one before it. Null when a point has no epoch (then x falls back to step). */
    function fractionalEpochs(steps, epochs) {
      if (epochs.some((e) => e === null || e === undefined)) return null;
      const first = new Map();
      steps.forEach((step, i) => {
        if (!first.has(epochs[i])) first.set(epochs[i], step);
      });
      const known = [...first.keys()].sort((a, b) => a - b);
      const length = new Map();
      let previous = null;
      for (const e of known) {
        if (first.has(e + 1)) previous = first.get(e + 1) - first.get(e);
        if (previous !== null && previous > 0) length.set(e, previous);
      }
      return steps.map((step, i) => {
        const e = epochs[i];
        const n = length.get(e);
        return n ? e + Math.min(0.999, (step - first.get(e)) / n) : e;
      });
    }

    /* The x values of series ``s`` in the current mode, and what they are ("step" when an
     * epoch or a time is missing). */
    function xValues(s) {
      if (state.xMode === "epoch") {
        const x = fractionalEpochs(s.steps, s.epochs);
        if (x) return { mode: "epoch", x: x };
      }
      if (state.xMode === "time") {
        const times = s.times.map((t) => d.parseTime(t));
        if (times.length && times.every((t) => t !== null)) {
          // Relaunches may repeat a time: keep x non-decreasing, as uPlot needs.
          let last = -Infinity;
          return {
            mode: "time",
            x: times.map((t) => {
              last = Math.max(last, (t - times[0]) / 1000);
              return last;
            }),
          };
        }
      }
      return { mode: "step", x: s.steps.slice() };
    }

    function fmtElapsed(seconds) {
      if (seconds < 120) return seconds.toFixed(seconds < 10 ? 1 : 0) + " s";
      if (seconds < 7200) return (seconds / 60).toFixed(1) + " min";
      return (seconds / 3600).toFixed(1) + " h";
    }

    const X_LABELS = { step: "step", epoch: "epochs done", time: "wall time" };
    function fmtX(mode, v) {
      if (v === null || v === undefined) return "--";
      if (mode === "epoch") return v.toFixed(2);
      if (mode === "time") return fmtElapsed(v);
      return String(v);
    }

    /* EMA of ``values`` with weight ``alpha`` on the past, debiased (no pull towards 0 at the
     * start, as TensorBoard's smoothing); gaps stay gaps and do not reset the average. */
    function ema(values, alpha) {
      let acc = 0;
      let weight = 0;
      return values.map((v) => {
        if (v === null) return null;
        acc = alpha * acc + (1 - alpha) * v;
        weight = alpha * weight + (1 - alpha);
        return acc / weight;
      });
    }

    /* With no point hovered, the legend shows the newest point that has a value. */
    function showLatest(u) {
      // Before "ready" uPlot is still drawing: its own first legend pass comes next.
      if (u.status !== 1) return;
      if (u.legend.idx !== null && u.legend.idx !== undefined) return;
      const values = u.data[u.data.length - 1] || [];
      let idx = values.length - 1;
      while (idx > 0 && (values[idx] === null || values[idx] === undefined)) idx -= 1;
      if (idx >= 0) u.setLegend({ idx: idx }, false);
    }

    /* Resume markers (step x axis only): a dashed line where each attempt resumed. */
    function drawResumes(u, mode) {
      if (mode !== "step") return;
      const ctx = u.ctx;
      const top = u.bbox.top;
      const height = u.bbox.height;
      ctx.save();
      ctx.strokeStyle = "#7a4fb0";
      ctx.fillStyle = "#7a4fb0";
      ctx.lineWidth = Math.max(1, window.devicePixelRatio || 1);
      ctx.setLineDash([5, 4]);
      ctx.font = Math.round(11 * (window.devicePixelRatio || 1)) + "px sans-serif";
      for (const r of state.history.resumes) {
        const x = u.valToPos(r.step, "x", true);
        if (!Number.isFinite(x) || x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
        ctx.beginPath();
        ctx.moveTo(x, top);
        ctx.lineTo(x, top + height);
        ctx.stroke();
        ctx.fillText("attempt " + r.attempt, x + 4, top + 12 * (window.devicePixelRatio || 1));
      }
      ctx.restore();
    }

    /* ``extras``: series drawn under the curve (superseded attempts, rank-0-only points).
     * ``data``: the chart's columns (x first), whose point counts decide the markers. */
    function chartOptions(name, width, mode, extras, data) {
      const color = name === "loss" ? "#1f4e8c" : "#b15d00";
      const fmtY = (u, v) => (v === null || v === undefined ? "--" : d.fmtValue(v));
      const series = [{ label: X_LABELS[mode], value: (u, v) => fmtX(mode, v) }];
      for (const [i, extra] of (extras || []).entries()) {
        const dense = markedPoints(data[i + 1]) > MAX_MARKED_POINTS;
        if (extra.kind === "superseded") {
          series.push({
            label: "attempt " + extra.attempt + " (superseded)",
            stroke: "#9aa3b2",
            width: 1.5,
            dash: [6, 4],
            spanGaps: true,
            value: fmtY,
            ...(dense ? { points: { show: false } } : {}),
          });
        } else if (dense) {
          // Too many to ring each: rank 0's stretches of the curve drawn red.
          series.push({
            label: name + " (rank 0 only)",
            stroke: "#c0392b",
            width: 2,
            spanGaps: false,
            points: { show: false },
            value: fmtY,
          });
        } else {
          series.push({
            label: name + " (rank 0 only)",
            stroke: "#c0392b",
            paths: () => null,
            points: { show: true, size: 7, width: 1.5, stroke: "#c0392b", fill: "#ffffff" },
            value: fmtY,
          });
        }
      }
      const curve = data[(extras || []).length + 1];
      // Points no line shows (a curve of one point, one between NaN gaps, all at one x) get
      // a filled marker even where the series shows none (uPlot draws the filter's indices).
      const lone = d.lonePoints(data[0], curve) !== null;
      const loneFilter = (u, si, show) => (show ? null : d.lonePoints(u.data[0], u.data[si]));
      const marks = lone ? { size: 7, width: 1, fill: color } : {};
      const show = markedPoints(curve) > MAX_MARKED_POINTS ? { show: false } : {};
      const lines = { points: { ...show, ...marks, filter: loneFilter } };
      if (state.smoothing > 0) {
        series.push(
          { label: name + " (raw)", stroke: color + "40", width: 1, spanGaps: false, value: fmtY, ...lines },
          { label: name + " (EMA " + state.smoothing + ")", stroke: color, width: 2, spanGaps: false, value: fmtY, ...lines },
        );
      } else {
        series.push({ label: name, stroke: color, width: 1.5, spanGaps: false, value: fmtY, ...lines });
      }
      const xAxis = { label: X_LABELS[mode], size: 40 };
      if (mode !== "step") xAxis.values = (u, splits) => splits.map((v) => fmtX(mode, v));
      return {
        width: width,
        height: 220,
        legend: { show: true, live: true },
        cursor: { drag: { x: true, y: false } },
        scales: { x: { time: false }, y: state.logScale ? { distr: 3 } : { auto: true } },
        axes: [xAxis, { size: 60 }],
        series: series,
        hooks: {
          ready: [showLatest],
          setLegend: [showLatest],
          draw: [(u) => drawResumes(u, mode)],
          setScale: [(u, key) => (key === "x" && mode === "step" ? onZoom(name, u) : undefined)],
        },
      };
    }

    function ensureSeries(name) {
      let s = state.series.get(name);
      if (s) return s;
      const latest = d.el("span", { class: "latest" });
      const plot = d.el("div", { class: "plot" });
      const node = d.el(
        "div",
        { class: "chart", "data-metric": name, "data-points": "0" },
        d.el("h3", null, name + " ", latest),
        plot,
      );
      const charts = container;
      if (name === "loss") charts.prepend(node);
      else charts.append(node);
      s = {
        steps: [],
        epochs: [],
        times: [],
        raw: [],
        aggs: [],
        old: [],
        after: 0,
        loaded: false,
        node: node,
        plot: plot,
        latest: latest,
        chart: null,
      };
      state.series.set(name, s);
      emptyNote.hidden = true;
      return s;
    }

    function drawSeries(name, s) {
      s.node.dataset.points = String(s.steps.length);
      s.node.dataset.lastStep = String(s.steps.length ? s.steps[s.steps.length - 1] : 0);
      // Every point rank 0's own (a job that does not average over ranks): one curve, said
      // here, rather than a second series ringing each of its points.
      const rank0Only = s.aggs.length > 0 && s.aggs.every((a) => a === "rank0");
      s.latest.textContent = s.raw.length
        ? "latest " + d.fmtValue(s.raw[s.raw.length - 1]) + " at step " + s.steps[s.steps.length - 1] +
          (rank0Only ? " · rank 0's own values (not averaged over ranks)" : "")
        : "";
      s.node.dataset.rank0Only = String(rank0Only);
      s.node.dataset.resumeSteps = state.history.resumes.map((r) => r.step).join(",");
      s.node.dataset.supersededPoints = String(s.old.length);
      s.node.dataset.rank0Points = String(s.aggs.filter((a) => a === "rank0").length);
      if (!s.steps.length || typeof window.uPlot !== "function") return;
      let x = xValues(s);
      let values = s.raw.map(plotValue);
      let aggs = s.aggs;
      const extras = [];
      const under = [];
      if (x.mode === "step" && s.old.length) {
        // One x for every series: the current steps and the superseded ones, merged.
        const xs = [...new Set([...s.steps, ...s.old.map((p) => p.step)])].sort((a, b) => a - b);
        const at = new Map(xs.map((step, i) => [step, i]));
        const current = xs.map(() => null);
        const currentAgg = xs.map(() => null);
        s.steps.forEach((step, i) => {
          current[at.get(step)] = values[i];
          currentAgg[at.get(step)] = s.aggs[i];
        });
        const attempts = [...new Set(s.old.map((p) => p.attempt))].sort((a, b) => a - b);
        for (const attempt of attempts) {
          const ys = xs.map(() => null);
          for (const p of s.old) if (p.attempt === attempt) ys[at.get(p.step)] = plotValue(p.value);
          extras.push({ kind: "superseded", attempt: attempt });
          under.push(ys);
        }
        x = { mode: "step", x: xs };
        values = current;
        aggs = currentAgg;
      }
      if (!rank0Only && aggs.some((a) => a === "rank0")) {
        extras.push({ kind: "rank0" });
        under.push(values.map((v, i) => (aggs[i] === "rank0" ? v : null)));
      }
      const data = [x.x, ...under, values];
      if (state.smoothing > 0) data.push(ema(values, state.smoothing));
      s.node.dataset.x = x.mode;
      s.node.dataset.smoothing = String(state.smoothing);
      // A series whose x fell back to step (or back from it), or whose extra series changed,
      // needs its chart rebuilt.
      // Markers are set when a chart is built: crossing MAX_MARKED_POINTS rebuilds it too.
      const dense = data.slice(1).map((col) => (markedPoints(col) > MAX_MARKED_POINTS ? "d" : "s")).join("");
      const lone = d.lonePoints(data[0], values) !== null ? "/lone" : "";
      const shape = x.mode + "/" + extras.map((e) => e.kind + (e.attempt || "")).join(",") + "/" + dense + lone;
      if (s.chart && s.chartMode !== shape) {
        s.chart.destroy();
        s.chart = null;
      }
      const width = Math.max(200, s.plot.clientWidth || 300);
      if (!s.chart) {
        s.chart = new window.uPlot(chartOptions(name, width, x.mode, extras, data), data, s.plot);
        s.plot.ddpqChart = s.chart;
        s.chartMode = shape;
        if (resizer) resizer.observe(s.plot);
      } else {
        s.chart.setData(data);
        showLatest(s.chart);
      }
    }

    /* A step range zoomed into (a drag on the chart): once the drag settles, the server's
     * curve of just that range (re-bucketed from its rollups, so a million-step run shows
     * every spike of the range) is merged into the series; double-click zooms out. */
    function onZoom(name, u) {
      const s = state.series.get(name);
      if (!s || !s.steps.length) return;
      const lo = Math.max(1, Math.floor(u.scales.x.min));
      const hi = Math.ceil(u.scales.x.max);
      if (!(hi >= lo) || (lo <= s.steps[0] && hi >= s.steps[s.steps.length - 1])) return;
      if (s.zoomed === lo + "-" + hi) return; // this range is already in
      clearTimeout(s.zoomTimer);
      s.zoomTimer = setTimeout(() => {
        refineRange(name, s, lo, hi).catch((err) => {
          s.node.dataset.zoomError = String((err && err.message) || err);
        });
      }, 150);
    }

    async function refineRange(name, s, lo, hi) {
      const q = new URLSearchParams({
        name: name,
        from_step: String(lo),
        to_step: String(hi),
        max_points: String(FIRST_LOAD_MAX_POINTS),
      });
      const res = await d.api(base + "/metrics?" + q.toString());
      const held = new Map(s.steps.map((step, i) => [step, i]));
      const rows = s.steps.map((step, i) => [step, s.epochs[i], s.times[i], s.raw[i], s.aggs[i]]);
      for (const p of res.body.points || []) {
        if (!held.has(p.step)) rows.push([p.step, p.epoch, p.time, p.value, p.agg]);
      }
      rows.sort((a, b) => a[0] - b[0]);
      s.steps = rows.map((r) => r[0]);
      s.epochs = rows.map((r) => r[1]);
      s.times = rows.map((r) => r[2]);
      s.raw = rows.map((r) => r[3]);
      s.aggs = rows.map((r) => r[4]);
      s.after = Math.max(s.after, s.steps[s.steps.length - 1]);
      s.zoomed = lo + "-" + hi;
      drawSeries(name, s);
      // setData rescaled the chart to every point: back to the range zoomed into.
      if (s.chart) s.chart.setScale("x", { min: lo, max: hi });
      s.node.dataset.zoom = s.zoomed;
    }

    function resetCharts() {
      for (const [name, s] of state.series) {
        if (s.chart) s.chart.destroy();
        s.chart = null;
        drawSeries(name, s);
      }
    }

    async function loadSeries(name) {
      const s = ensureSeries(name);
      const q = new URLSearchParams({ name: name });
      let changed = false;
      if (!s.loaded || s.steps.length > MAX_KEPT_POINTS) {
        q.set("max_points", String(FIRST_LOAD_MAX_POINTS));
        // Earlier attempts' points come downsampled with the current ones: one request.
        if (state.history.lost.length) q.set("include_superseded", "true");
        const res = await d.api(base + "/metrics?" + q.toString());
        q.delete("include_superseded");
        const all = res.body.points || [];
        const points = all.filter((p) => !p.superseded);
        s.steps = points.map((p) => p.step);
        s.epochs = points.map((p) => p.epoch);
        s.times = points.map((p) => p.time);
        s.raw = points.map((p) => p.value);
        s.aggs = points.map((p) => p.agg);
        s.after = points.length ? points[points.length - 1].step : Number(res.body.next_after_step) || 0;
        s.old = all.filter(isLostPoint);
        s.loaded = true;
        s.zoomed = null; // a range merged in before is gone with the reload
        changed = true;
      }
      // Incremental: everything after the last step we hold, a page at a time.
      for (let page = 0; page < 5; page += 1) {
        q.delete("max_points");
        q.set("after_step", String(s.after));
        q.set("limit", String(PAGE_LIMIT));
        const res = await d.api(base + "/metrics?" + q.toString());
        const points = res.body.points || [];
        for (const p of points) {
          if (p.step <= s.after) continue;
          s.steps.push(p.step);
          s.epochs.push(p.epoch);
          s.times.push(p.time);
          s.raw.push(p.value);
          s.aggs.push(p.agg);
          s.after = p.step;
        }
        if (points.length) changed = true;
        if (points.length < PAGE_LIMIT) break;
      }
      if (changed || !s.chart) drawSeries(name, s);
      return changed;
    }

    /* A superseded point of a step range a resume lost (from the ledger). */
    function isLostPoint(p) {
      return Boolean(p.superseded) && state.history.lost.some(
        (r) => p.attempt === r.attempt && p.step >= r.from && p.step <= r.to);
    }

    /* ``history``: {resumes: [{attempt, step}], lost: [{attempt, from, to}]} from the goodput
     * ledger. A change (a new resume) reloads every series: a resumed attempt's points
     * replace earlier ones at steps the page already holds. */
    function setHistory(history) {
      const key = JSON.stringify(history);
      if (key === state.historyKey) return;
      state.historyKey = key;
      state.history = { resumes: history.resumes || [], lost: history.lost || [] };
      for (const s of state.series.values()) s.loaded = false;
    }

    async function refresh(fetchNames) {
      if (fetchNames || !state.names.length) {
        const res = await d.api(base + "/metrics/names");
        const names = (res.body.names || []).slice();
        names.sort((a, b) => (a === "loss" ? -1 : b === "loss" ? 1 : a.localeCompare(b)));
        state.names = names;
      }
      let changed = false;
      for (const name of state.names) {
        // One series the page cannot load (e.g. a row an older version stored) must not keep
        // the other charts, the log and the checkpoints from loading: note it on its chart.
        try {
          if (await loadSeries(name)) changed = true;
          ensureSeries(name).node.removeAttribute("data-error");
        } catch (err) {
          const s = ensureSeries(name);
          const why = err && typeof err.detail === "string" ? err.detail : String((err && err.message) || err);
          s.node.dataset.error = why;
          s.latest.textContent = "could not load: " + why;
        }
      }
      return changed;
    }

    function setLogScale(on) {
      state.logScale = Boolean(on);
      resetCharts();
    }

    /* ``mode``: "step", "epoch" or "time". */
    function setXAxis(mode) {
      state.xMode = X_LABELS[mode] ? mode : "step";
      resetCharts();
    }

    /* ``alpha``: 0 (off) or the EMA's weight on the past, e.g. 0.9. */
    function setSmoothing(alpha) {
      const a = Number(alpha);
      state.smoothing = Number.isFinite(a) && a > 0 && a < 1 ? a : 0;
      resetCharts();
    }

    return {
      refresh: refresh,
      setHistory: setHistory,
      setLogScale: setLogScale,
      setXAxis: setXAxis,
      setSmoothing: setSmoothing,
    };
  }

  window.ddpqCharts = { metricCharts: metricCharts };
})();
