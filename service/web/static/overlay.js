/* ddpq dashboard: charts that overlay many runs (the compare page, a sweep's trials) and a
 * scatter of one value against another, both drawn by the vendored uPlot. Each overlaid run
 * has its own x values (uPlot's mode 2), so runs that logged at different steps need no
 * shared x table. Hovering shows the nearest run's point in a readout line (a legend of 100
 * trials would not fit). Values may be null (NaN) or "Infinity": drawn as gaps. A point no
 * line shows (a run of one point, one between gaps, runs all at one step) gets a marker. */
"use strict";

(function () {
  const d = window.ddpq;
  const HEIGHT = 240;
  const PALETTE = ["#1f4e8c", "#b15d00", "#2e7d32", "#8e24aa", "#c62828", "#00838f", "#6d4c41", "#5c6bc0", "#9e9d24", "#d81b60"];

  function paletteColor(i) {
    return PALETTE[i % PALETTE.length];
  }

  /* A color from light (t = 0) to strong blue (t = 1): trials shaded by their objective rank. */
  function rankColor(t) {
    const c = Math.max(0, Math.min(1, t));
    const from = [170, 190, 215];
    const to = [20, 60, 140];
    const rgb = from.map((f, i) => Math.round(f + (to[i] - f) * c));
    return "rgb(" + rgb.join(",") + ")";
  }

  /* Index of the value in ascending ``xs`` nearest to ``x``. */
  function nearestIndex(xs, x) {
    let lo = 0;
    let hi = xs.length - 1;
    while (hi - lo > 1) {
      const mid = (lo + hi) >> 1;
      if (xs[mid] < x) lo = mid;
      else hi = mid;
    }
    return Math.abs(xs[hi] - x) < Math.abs(xs[lo] - x) ? hi : lo;
  }

  function plotValue(v, logScale) {
    const n = d.metricNumber(v);
    if (n === null || !Number.isFinite(n)) return null;
    if (logScale && n <= 0) return null;
    return n;
  }

  /* A scale's range with room around a single value (uPlot cannot split an empty range). */
  function padded(u, min, max) {
    if (min === null || max === null) return [0, 1];
    if (min === max) {
      const pad = min === 0 ? 1 : Math.abs(min) * 0.1;
      return [min - pad, max + pad];
    }
    return [min, max];
  }

  /* A scatter's scale ranges: a margin of ``SCATTER_MARGIN`` of the span on each side, so
   * the points at the extremes (and their markers) sit inside the plot, not on its edges.
   * On a log scale the margin is in decades. */
  const SCATTER_MARGIN = 0.08;
  function withMargin(u, min, max) {
    const range = padded(u, min, max);
    const pad = (range[1] - range[0]) * SCATTER_MARGIN;
    return [range[0] - pad, range[1] + pad];
  }
  function withLogMargin(u, min, max) {
    if (min === null || max === null || !(min > 0) || !(max > 0)) return [1, 10];
    const lo = Math.log10(min);
    const hi = Math.log10(max);
    const pad = (hi > lo ? hi - lo : 1) * SCATTER_MARGIN;
    return [Math.pow(10, lo - pad), Math.pow(10, hi + pad)];
  }

  /* Width of ``node``'s box in pixels (at least 200). */
  function widthOf(node) {
    return Math.max(200, Math.floor(node.clientWidth || 300));
  }

  const resizer =
    typeof ResizeObserver === "function"
      ? new ResizeObserver((entries) => {
          window.requestAnimationFrame(() => {
            for (const entry of entries) {
              const chart = entry.target.ddpqChart;
              const width = widthOf(entry.target);
              if (chart && Math.abs(chart.width - width) > 1) chart.setSize({ width: width, height: HEIGHT });
            }
          });
        })
      : null;

  /* An overlay chart in ``plot`` (an empty element); ``readout`` shows the hovered point.
   * draw(runs, {logScale}) takes runs [{id, label, color, width, points: [[step, value]…]}]
   * and rebuilds the chart (cheap for a few hundred thousand points). */
  function overlayChart(plot, readout, xLabel) {
    let chart = null;
    let runs = [];

    function showNearest(u) {
      const left = u.cursor.left;
      const top = u.cursor.top;
      if (left === null || left === undefined || left < 0 || !runs.length) {
        d.setText(readout, "\u00a0");
        plot.dataset.hover = "";
        return;
      }
      const x = u.posToVal(left, "x");
      let best = null;
      for (let i = 0; i < runs.length; i += 1) {
        const [xs, ys] = u.data[i + 1];
        if (!xs.length) continue;
        const k = nearestIndex(xs, x);
        if (ys[k] === null) continue;
        const dx = u.valToPos(xs[k], "x") - left;
        const dy = u.valToPos(ys[k], "y") - top;
        const dist = dx * dx + dy * dy;
        if (best === null || dist < best.dist) best = { dist: dist, i: i, step: xs[k], value: ys[k] };
      }
      if (best === null) {
        d.setText(readout, "\u00a0");
        return;
      }
      plot.dataset.hover = String(runs[best.i].id);
      d.setText(readout, runs[best.i].label + ": " + d.fmtValue(best.value) + " at " + xLabel + " " + best.step);
    }

    function draw(newRuns, options) {
      const opts = options || {};
      runs = newRuns;
      const data = [null];
      const series = [{}];
      let points = 0;
      for (const run of runs) {
        const xs = [];
        const ys = [];
        for (const [step, value] of run.points) {
          xs.push(step);
          ys.push(plotValue(value, opts.logScale));
        }
        points += xs.length;
        data.push([xs, ys]);
        series.push({
          label: run.label,
          stroke: run.color,
          width: run.width || 1.25,
          facets: [
            { scale: "x", auto: true },
            { scale: "y", auto: true },
          ],
          paths: window.uPlot.paths.linear(),
          // No marker on every point of a curve (a hundred overlaid curves), but one on each
          // point no line shows: a run of one point (an eval once per epoch, a 1-epoch trial)
          // or one between NaN gaps. In mode 2 uPlot draws only the filter's indices.
          points: {
            show: false,
            size: 5 + 2 * (run.width || 1.25),
            width: 1,
            fill: run.color,
            filter: (u, si) => d.lonePoints(u.data[si][0], u.data[si][1]),
          },
        });
      }
      plot.dataset.runs = String(runs.length);
      plot.dataset.points = String(points);
      if (chart) chart.destroy();
      chart = null;
      const y = opts.logScale ? { distr: 3 } : { auto: true, range: padded };
      if (!points || typeof window.uPlot !== "function") return;
      chart = new window.uPlot(
        {
          mode: 2,
          width: widthOf(plot),
          height: HEIGHT,
          legend: { show: false },
          scales: { x: { time: false, range: padded }, y: y },
          axes: [{ label: xLabel, size: 40 }, { size: 60 }],
          cursor: { drag: { x: true, y: false } },
          series: series,
          hooks: { setCursor: [showNearest] },
        },
        data,
        plot,
      );
      plot.ddpqChart = chart;
      if (resizer) resizer.observe(plot);
    }

    return { draw: draw };
  }

  /* A scatter chart in ``plot``: draw(points [{x, y, id, label, best}], {xLabel, yLabel,
   * categories}) — with ``categories`` (a list of texts) x is an index into it. */
  function scatterChart(plot, readout) {
    let chart = null;

    function draw(points, options) {
      const opts = options || {};
      const shown = points.filter((p) => p.y !== null && Number.isFinite(p.y) && p.x !== null && Number.isFinite(p.x));
      shown.sort((a, b) => a.x - b.x);
      plot.dataset.points = String(shown.length);
      if (chart) chart.destroy();
      chart = null;
      if (!shown.length || typeof window.uPlot !== "function") return;
      const xs = shown.map((p) => p.x);
      const ys = shown.map((p) => (p.best ? null : p.y));
      const bestYs = shown.map((p) => (p.best ? p.y : null));
      const cats = opts.categories;
      const xAxis = { label: opts.xLabel, size: 40 };
      if (cats) {
        xAxis.values = (u, splits) => splits.map((v) => (Number.isInteger(v) && cats[v] !== undefined ? cats[v] : ""));
        xAxis.splits = () => cats.map((_, i) => i);
      }
      const xScale = { time: false };
      if (cats) xScale.range = () => [-0.5, cats.length - 0.5];
      else if (opts.logX) Object.assign(xScale, { distr: 3, range: withLogMargin });
      else xScale.range = withMargin;
      const dot = (color, size) => ({ show: true, size: size, stroke: color, fill: color + "99" });
      chart = new window.uPlot(
        {
          width: widthOf(plot),
          height: HEIGHT,
          legend: { show: false },
          scales: { x: xScale, y: { auto: true, range: withMargin } },
          axes: [xAxis, { label: opts.yLabel, size: 60 }],
          series: [
            {},
            { label: opts.yLabel, stroke: "#1f4e8c", paths: () => null, points: dot("#1f4e8c", 7) },
            { label: "best", stroke: "#b3261e", paths: () => null, points: dot("#b3261e", 11) },
          ],
          cursor: { drag: { x: false, y: false } },
          hooks: {
            setCursor: [
              (u) => {
                const idx = u.cursor.idx;
                if (idx === null || idx === undefined || !shown[idx]) {
                  d.setText(readout, "\u00a0");
                  return;
                }
                const p = shown[idx];
                d.setText(readout, p.label + ": " + opts.yLabel + " " + d.fmtValue(p.y));
              },
            ],
          },
        },
        [xs, ys, bestYs],
        plot,
      );
      plot.ddpqChart = chart;
      if (resizer) resizer.observe(plot);
    }

    return { draw: draw };
  }

  /* A spec (nested objects) as {dotted.path: JSON text of the leaf}; lists are leaves. */
  function flatten(value, prefix, out) {
    const into = out || {};
    if (value !== null && typeof value === "object" && !Array.isArray(value)) {
      const keys = Object.keys(value);
      if (!keys.length && prefix) into[prefix] = "{}";
      for (const key of keys) flatten(value[key], prefix ? prefix + "." + key : key, into);
    } else if (prefix) {
      into[prefix] = JSON.stringify(value === undefined ? null : value);
    }
    return into;
  }

  window.ddpqOverlay = {
    overlayChart: overlayChart,
    scatterChart: scatterChart,
    paletteColor: paletteColor,
    rankColor: rankColor,
    flatten: flatten,
  };
})();
