/* ddpq dashboard: a job's metric curves (one uPlot chart per metric name). The first load of a
 * series asks for a downsampled history (max_points); after that only steps after the last one
 * held are fetched (after_step). Values may be null (NaN) or "Infinity"/"-Infinity": they are
 * drawn as gaps. Each chart's element carries data-points and data-last-step. */
"use strict";

(function () {
  const d = window.ddpq;
  const FIRST_LOAD_MAX_POINTS = 2000; // downsample long histories on first load
  const PAGE_LIMIT = 1000; // points per incremental request
  const MAX_KEPT_POINTS = 20000; // past this, reload the series downsampled

  /* Charts of job ``base`` ("jobs/<id>") inside ``container``; ``emptyNote`` hides once a
   * metric exists. refresh(fetchNames) resolves to true when any series got new points. */
  function metricCharts(base, container, emptyNote) {
    const state = { series: new Map(), names: [], logScale: false };

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

    function chartOptions(name, width) {
      return {
        width: width,
        height: 220,
        legend: { show: true, live: true },
        cursor: { drag: { x: true, y: false } },
        scales: { x: { time: false }, y: state.logScale ? { distr: 3 } : { auto: true } },
        axes: [{ label: "step", size: 40 }, { size: 60 }],
        series: [
          { label: "step" },
          {
            label: name,
            stroke: name === "loss" ? "#1f4e8c" : "#b15d00",
            width: 1.5,
            spanGaps: false,
          },
        ],
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
        raw: [],
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
      s.latest.textContent = s.raw.length
        ? "latest " + d.fmtValue(s.raw[s.raw.length - 1]) + " at step " + s.steps[s.steps.length - 1]
        : "";
      if (!s.steps.length || typeof window.uPlot !== "function") return;
      const data = [s.steps.slice(), s.raw.map(plotValue)];
      const width = Math.max(200, s.plot.clientWidth || 300);
      if (!s.chart) {
        s.chart = new window.uPlot(chartOptions(name, width), data, s.plot);
        if (resizer) resizer.observe(s.plot);
      } else {
        s.chart.setData(data);
      }
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
        const res = await d.api(base + "/metrics?" + q.toString());
        const points = res.body.points || [];
        s.steps = points.map((p) => p.step);
        s.raw = points.map((p) => p.value);
        s.after = points.length ? points[points.length - 1].step : Number(res.body.next_after_step) || 0;
        s.loaded = true;
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
          s.raw.push(p.value);
          s.after = p.step;
        }
        if (points.length) changed = true;
        if (points.length < PAGE_LIMIT) break;
      }
      if (changed || !s.chart) drawSeries(name, s);
      return changed;
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

    return { refresh: refresh, setLogScale: setLogScale };
  }

  window.ddpqCharts = { metricCharts: metricCharts };
})();
