/* ddpq dashboard: a job's goodput panel (GET /jobs/{id}/goodput) — one stacked bar per attempt
 * with its phases to scale (queued, starting, restore, productive, checkpoint stall, lost work,
 * in progress, teardown), a legend with the job's totals, the steps lost to restarts and the Young/Daly
 * checkpoint-interval estimate — and the curves' history marks taken from the same ledger
 * (where attempts resumed, which step ranges they superseded). job.js fetches the ledger. */
"use strict";

(function () {
  const d = window.ddpq;
  const $ = (id) => document.getElementById(id);

  const PHASES = [
    ["queued", "queued"],
    ["starting", "starting"],
    ["restore", "restore"],
    ["productive", "productive"],
    ["checkpoint_stall", "checkpoint stall"],
    ["lost", "lost work"],
    ["in_progress", "in progress"],
    ["teardown", "teardown"],
  ];

  function fmtShare(x) {
    return typeof x === "number" && Number.isFinite(x) ? (x * 100).toFixed(0) + "%" : "?";
  }

  function fmtSecs(s) {
    if (typeof s !== "number" || !Number.isFinite(s)) return "?";
    return s < 10 ? s.toFixed(1) + " s" : d.fmtDuration(s);
  }

  /* The curves' history marks from the ledger: where each attempt resumed and which steps of
   * earlier attempts its resume threw away. */
  function historyOf(ledger) {
    const resumes = [];
    const lost = [];
    for (const a of ledger.attempts || []) {
      if (a.attempt > 1 && a.resume_step !== null && a.resume_step !== undefined)
        resumes.push({ attempt: a.attempt, step: a.resume_step });
      if (a.lost_steps_range)
        lost.push({ attempt: a.attempt, from: a.lost_steps_range[0], to: a.lost_steps_range[1], by: a.superseded_by });
    }
    return { resumes: resumes, lost: lost };
  }

  function render(ledger) {
    const panel = $("goodput-panel");
    const claimed = (ledger.attempts || []).some((a) => a.claimed_at);
    panel.hidden = !claimed;
    if (!claimed) return;
    d.setText(
      "goodput-summary",
      (ledger.goodput === null
        ? "goodput not measured (no training step reported) · " + fmtSecs(ledger.wall_s)
        : "goodput " + fmtShare(ledger.goodput) + " of " + fmtSecs(ledger.wall_s)) +
        " since submission" +
        (ledger.lost_steps ? " · " + ledger.lost_steps + " steps lost to restarts" : ""),
    );
    const bars = $("goodput-bars");
    d.clear(bars);
    // Every bar to one scale (the longest attempt), so lengths compare across attempts.
    const longest = Math.max(...ledger.attempts.map((a) => a.wall_s || 0), 1e-9);
    for (const a of ledger.attempts) {
      const bar = d.el("div", {
        class: "gp-bar",
        "data-attempt": a.attempt,
        "data-lost-range": a.lost_steps_range ? a.lost_steps_range.join("-") : "",
        role: "img",
        "aria-label": "attempt " + a.attempt + ": " + PHASES.map(([k, label]) => label + " " + fmtSecs(a[k + "_s"])).join(", "),
      });
      bar.style.width = Math.max(2, (100 * (a.wall_s || 0)) / longest).toFixed(2) + "%";
      for (const [key, label] of PHASES) {
        const secs = a[key + "_s"] || 0;
        if (secs <= 0) continue;
        const seg = d.el("span", {
          class: "gp-seg gp-" + key,
          "data-phase": key,
          title: label + ": " + fmtSecs(secs) + (key === "lost" && a.lost_steps_range ? " (steps " + a.lost_steps_range.join("–") + ")" : ""),
        });
        seg.style.width = ((100 * secs) / (a.wall_s || 1)).toFixed(3) + "%";
        bar.append(seg);
      }
      bars.append(
        d.el("span", { class: "gp-label" }, "attempt " + a.attempt + (a.resume_step ? " (from step " + a.resume_step + ")" : "")),
        d.el("div", null, bar),
      );
    }
    const legend = $("goodput-legend");
    d.clear(legend);
    for (const [key, label] of PHASES) {
      if (key === "in_progress" && !ledger[key + "_s"]) continue; // only while an attempt runs
      legend.append(d.el("li", null, d.el("span", { class: "swatch gp-" + key }), label + " " + fmtSecs(ledger[key + "_s"])));
    }
    const lost = historyOf(ledger).lost;
    const lostNote = $("goodput-lost");
    lostNote.hidden = !lost.length;
    d.setText(
      lostNote,
      lost
        .map((l) => "Attempt " + l.attempt + " trained steps " + l.from + "–" + l.to + " that attempt " + l.by + " trained again after resuming from step " + (l.from - 1) + " (dashed on the curves).")
        .join(" "),
    );
    const est = ledger.checkpoint_interval;
    const estNote = $("goodput-interval");
    estNote.hidden = !est;
    if (est) {
      d.setText(
        estNote,
        "Estimate (Young/Daly, sqrt(2 × save cost × MTBF)): checkpoint every ~" + fmtSecs(est.interval_s) +
          (est.interval_steps ? " (~" + est.interval_steps + " steps" + (est.current_interval_steps ? "; now every " + est.current_interval_steps : "") + ")" : "") +
          " from a save cost of " + fmtSecs(est.save_cost_s) + " and " + fmtSecs(est.mtbf_s) + " between failures.",
      );
    }
  }

  window.ddpqGoodput = { render: render, historyOf: historyOf };
})();
