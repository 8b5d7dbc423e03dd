/* ddpq dashboard: what the sweep list and a sweep's page both show — trial counts by
 * outcome, the objective in words, override values as text. */
"use strict";

(function () {
  const d = window.ddpq;
  // The order outcomes are listed in (the API may add more: those come after).
  const OUTCOMES = ["running", "starting", "queued", "succeeded", "stopped_early", "failed", "cancelled"];
  const SWEEP_LIVE = ["running"];

  /* A badge per outcome with trials: "3 running", "1 failed"… */
  function countBadges(counts) {
    const box = d.el("span", { class: "counts" });
    const names = Object.keys(counts || {}).sort((a, b) => {
      const ia = OUTCOMES.indexOf(a);
      const ib = OUTCOMES.indexOf(b);
      return (ia < 0 ? 99 : ia) - (ib < 0 ? 99 : ib);
    });
    for (const name of names) {
      const n = Number(counts[name]) || 0;
      if (!n) continue;
      const badge = d.badge(name);
      badge.textContent = n + " " + name.replace("_", " ");
      badge.dataset.count = String(n);
      box.append(badge);
    }
    return box;
  }

  /* {metric, mode, at} → "eval_accuracy (max, best)". */
  function objectiveText(objective) {
    const o = objective || {};
    if (!o.metric) return "–";
    return o.metric + " (" + [o.mode, o.at].filter(Boolean).join(", ") + ")";
  }

  /* An override's value as a table cell's text (numbers as the API sends them). */
  function valueText(value) {
    if (value === undefined) return "–";
    if (typeof value === "string") return value;
    return JSON.stringify(value);
  }

  window.ddpqSweeps = {
    countBadges: countBadges,
    objectiveText: objectiveText,
    valueText: valueText,
    SWEEP_LIVE: SWEEP_LIVE,
  };
})();
