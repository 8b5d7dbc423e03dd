/* ddpq dashboard: one job's page — header, progress, curves (uPlot), logs, timeline,
 * checkpoints, spec, error panel and cancel. Polls the API while the job is live. */
"use strict";

(function () {
  const d = window.ddpq;
  const jobId = Number(document.body.dataset.jobId);
  const base = "jobs/" + jobId;
  const MAX_LOG_CHARS = 200000; // characters of log kept on the page
  const $ = (id) => document.getElementById(id);

  const view = {
    job: null,
    etag: null,
    eventsKey: null,
    checkpointsKey: null,
    goodputKey: null,
    goodputWaiting: false,
    log: { rank: 0, attempt: null, offset: 0, eof: false, userPickedAttempt: false },
    drained: false,
  };

  /* ---------- header, facts, progress, error, cancel ---------- */

  function isLive(job) {
    return d.LIVE_STATES.includes(job.state);
  }

  function worldSize(spec) {
    const r = (spec && spec.resources) || {};
    return (Number(r.nnodes) || 1) * (Number(r.nproc_per_node) || 1);
  }

  /* Why a job waits (the API's `queue`): the one-line reason, its place and the jobs
   * ahead, each worker's verdict; or Slurm's pending reason in plain words. */
  function renderQueue(job) {
    const node = $("queue-reason");
    const q = job.queue;
    node.hidden = !(job.queue_reason && (job.state === "queued" || q));
    if (node.hidden) return;
    const lines = ["Waiting: " + job.queue_reason];
    if (q && !q.scheduler && q.position !== null) {
      const ahead = q.ahead.map(
        (a) =>
          "job " + a.id + (a.name !== null ? " “" + a.name + "”" : "") +
          " (priority " + a.priority + ")",
      );
      if (q.ahead_count > ahead.length) ahead.push(q.ahead_count - ahead.length + " more");
      const behind = ahead.length ? "; ahead: " + ahead.join(", ") : "";
      lines.push("Position " + q.position + " in the queue" + behind);
    }
    for (const w of (q && q.workers) || []) {
      const verdict = w.can_now
        ? "can run it now"
        : (w.can_ever ? "not now: " : "never: ") + w.why_not.join("; ");
      const notes = w.notes.map((n) => " — " + n).join("");
      lines.push("Worker " + w.id + " (" + w.launcher + "): " + verdict + notes);
    }
    node.style.whiteSpace = "pre-line";
    d.setText(node, lines.join("\n"));
  }

  function renderJob(job) {
    document.title = job.name + " · job " + job.id + " · ddpq";
    d.setText("job-name", job.name);
    d.setBadge($("job-state"), job.state);
    const spec = job.spec || {};
    const r = spec.resources || {};
    d.setText("f-owner", job.owner);
    d.setText("f-task", spec.task || "–");
    d.setText(
      "f-launcher",
      (job.launcher || spec.launcher || "–") +
        (job.scheduler_job_id ? " (Slurm " + job.scheduler_job_id + ")" : ""),
    );
    d.setText(
      "f-ranks",
      (r.nnodes || 1) +
        " × " +
        (r.nproc_per_node || 1) +
        " = " +
        worldSize(spec) +
        " (" +
        (spec.backend || "auto") +
        ")",
    );
    d.setText(
      "f-attempt",
      job.attempt + (spec.max_restarts ? " (max restarts " + spec.max_restarts + ")" : ""),
    );
    d.setText("f-worker", job.worker_id || "–");
    $("f-sweep-box").hidden = !job.sweep_id;
    if (job.sweep_id) {
      $("f-sweep").href = "/sweeps/" + job.sweep_id;
      d.setText("f-sweep", "sweep #" + job.sweep_id);
    }
    d.setText("f-created", d.fmtTime(job.created_at));
    const started = d.parseTime(job.started_at);
    const finished = d.parseTime(job.finished_at);
    d.setText(
      "f-runtime",
      started === null ? "not started" : d.fmtDuration(((finished || Date.now()) - started) / 1000),
    );

    const p = d.describeProgress(job.progress, job.state);
    const bar = $("progress-bar");
    bar.style.width = (p.fraction * 100).toFixed(1) + "%";
    bar.classList.toggle("done", job.state === "succeeded");
    bar.classList.toggle("failed", job.state === "failed");
    d.setText("progress-text", [p.text, p.eta].filter(Boolean).join(" · ") || "No progress reported yet.");

    renderQueue(job);

    const errorPanel = $("error-panel");
    errorPanel.hidden = !job.error;
    if (job.error) d.setText("error-text", job.error);

    const live = isLive(job);
    $("cancel-box").hidden = !live || job.cancel_requested;
    const note = $("cancel-note");
    if (job.state === "cancelled") {
      note.hidden = false;
      d.setText(
        note,
        "This job was cancelled" + (job.finished_at ? " at " + d.fmtTime(job.finished_at) : "") + ".",
      );
    } else if (live && job.cancel_requested) {
      note.hidden = false;
      d.setText(note, "Cancel requested: waiting for the worker to stop the ranks.");
    } else {
      note.hidden = true;
    }
    renderSpec(spec);
    syncLogPickers(job);
  }

  function kvText(obj) {
    return Object.entries(obj || {})
      .filter(([, v]) => v !== null && v !== undefined && !(typeof v === "object" && !Object.keys(v).length))
      .map(([k, v]) => k + "=" + (typeof v === "object" ? JSON.stringify(v) : String(v)))
      .join(", ");
  }

  let renderedSpec = null;
  function renderSpec(spec) {
    const json = JSON.stringify(spec, null, 2);
    if (json === renderedSpec) return;
    renderedSpec = json;
    d.setText("spec-json", json);
    const dl = $("spec-summary");
    d.clear(dl);
    const rows = [
      ["name", spec.name],
      ["task", spec.task],
      ["launcher", spec.launcher],
      ["backend", spec.backend + (spec.strategy && spec.strategy !== "ddp" ? " · " + spec.strategy : "")],
      ["resources", kvText(spec.resources)],
      ["training", kvText(spec.training)],
      ["config", kvText(spec.config)],
      ["slurm", kvText(spec.slurm)],
      ["max_restarts", spec.max_restarts],
      ["priority", spec.priority],
      ["tags", (spec.tags || []).join(", ")],
    ];
    for (const [key, value] of rows) {
      if (value === null || value === undefined || value === "") continue;
      dl.append(d.el("div", null, d.el("dt", null, key), d.el("dd", { class: "mono" }, value)));
    }
  }

  /* ---------- timeline and checkpoints ---------- */

  async function refreshEvents(job) {
    const key = job.state + "/" + job.attempt + "/" + job.cancel_requested;
    if (key === view.eventsKey) return;
    const res = await d.api(base + "/events");
    view.eventsKey = key;
    const list = $("timeline");
    d.clear(list);
    for (const ev of res.body.events || []) {
      const from = ev.from_state ? ev.from_state + " → " : "";
      list.append(
        d.el(
          "li",
          { "data-to-state": ev.to_state, "data-kind": ev.kind },
          d.el(
            "span",
            { class: "when", title: ev.created_at },
            d.fmtTime(ev.created_at) + " · attempt " + ev.attempt,
          ),
          from,
          d.badge(ev.to_state),
          ev.reason ? d.el("span", { class: "why" }, " " + ev.reason) : null,
          ev.worker_id ? d.el("span", { class: "why" }, " (" + ev.worker_id + ")") : null,
        ),
      );
    }
  }

  async function refreshCheckpoints(job) {
    const step = job.progress && job.progress.step;
    const key = job.state + "/" + step + "/" + job.attempt;
    if (key === view.checkpointsKey) return;
    const res = await d.api(base + "/checkpoints");
    view.checkpointsKey = key;
    const rows = res.body.checkpoints || [];
    const tbody = $("checkpoints-body");
    d.clear(tbody);
    for (const c of rows) {
      tbody.append(
        d.el(
          "tr",
          { "data-step": c.step },
          d.el("td", { class: "num" }, c.step),
          d.el("td", { class: "num" }, d.epochNumber(c) === null ? "–" : d.epochNumber(c)),
          d.el("td", { class: "opt num" }, c.attempt),
          d.el("td", { class: "num" }, d.fmtBytes(c.size_bytes)),
          d.el("td", { class: "opt mono", title: c.sha256 }, String(c.sha256 || "").slice(0, 12)),
          d.el(
            "td",
            null,
            d.el(
              "a",
              {
                href: d.API + "/" + base + "/checkpoints/" + c.step + "/file",
                download: "job-" + jobId + "-step-" + c.step + ".pt",
              },
              c.file_name ? "download " + c.file_name : "download",
            ),
          ),
        ),
      );
    }
    $("checkpoints-empty").hidden = rows.length > 0;
  }

  const charts = window.ddpqCharts.metricCharts(base, $("charts"), $("charts-empty"));

  /* ---------- where the time went (GET /jobs/{id}/goodput; goodput.js draws it) ---------- */

  async function refreshGoodput(job) {
    // Fetched when the attempt or state changes, while the newest attempt has not told its
    // resume step yet, and every 10th tick while the job lives (the bar grows).
    const key = job.state + "/" + job.attempt;
    const waiting = view.goodputWaiting && isLive(job);
    if (key === view.goodputKey && !waiting && !(isLive(job) && ticks % 10 === 0)) return;
    let res;
    try {
      res = await d.api(base + "/goodput");
    } catch (err) {
      view.goodputKey = key; // the ledger is extra: the rest of the page goes on without it
      $("goodput-panel").hidden = true;
      return;
    }
    view.goodputKey = key;
    const ledger = res.body;
    const newest = (ledger.attempts || [])[ledger.attempts.length - 1];
    view.goodputWaiting = Boolean(newest && newest.attempt > 1 && newest.claimed_at && newest.resume_step === null);
    window.ddpqGoodput.render(ledger);
    charts.setHistory(window.ddpqGoodput.historyOf(ledger));
  }

  /* ---------- logs ---------- */

  function syncLogPickers(job) {
    const rankSelect = $("log-rank");
    const size = worldSize(job.spec);
    if (rankSelect.options.length !== size) {
      const keep = rankSelect.value;
      d.clear(rankSelect);
      for (let r = 0; r < size; r += 1) rankSelect.append(d.el("option", { value: r }, String(r)));
      rankSelect.value = Number(keep) < size ? keep : "0";
    }
    const attemptSelect = $("log-attempt");
    if (attemptSelect.options.length !== job.attempt) {
      d.clear(attemptSelect);
      for (let a = 1; a <= job.attempt; a += 1) attemptSelect.append(d.el("option", { value: a }, String(a)));
    }
    if (view.log.attempt === null || (!view.log.userPickedAttempt && view.log.attempt !== job.attempt)) {
      switchLog(view.log.rank, job.attempt);
    }
    attemptSelect.value = String(view.log.attempt);
  }

  function switchLog(rank, attempt) {
    view.log.rank = rank;
    view.log.attempt = attempt;
    view.log.offset = 0;
    view.log.eof = false;
    view.log.generation = (view.log.generation || 0) + 1;
    d.setText("log-text", "");
    d.setText("log-status", "");
  }

  async function refreshLog(job) {
    const lg = view.log;
    if (job.state === "queued" && !job.started_at && job.attempt === 1) {
      d.setText("log-status", "The job has not started; no log yet.");
      return;
    }
    if (lg.eof && !isLive(job)) return;
    const pre = $("log-text");
    const generation = lg.generation;
    for (let page = 0; page < 10; page += 1) {
      const q = new URLSearchParams({
        rank: String(lg.rank),
        attempt: String(lg.attempt),
        offset: String(lg.offset),
      });
      const res = await d.api(base + "/logs?" + q.toString());
      if (generation !== lg.generation) return; // the user switched rank/attempt meanwhile
      const chunk = res.body;
      const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 20;
      if (chunk.text) {
        let text = pre.textContent + chunk.text;
        if (text.length > MAX_LOG_CHARS) text = "…\n" + text.slice(text.length - MAX_LOG_CHARS);
        pre.textContent = text;
        if ($("log-follow").checked && atBottom) pre.scrollTop = pre.scrollHeight;
      }
      lg.offset = Number(chunk.next_offset) || lg.offset;
      lg.eof = Boolean(chunk.eof);
      if (!chunk.text || lg.eof) break;
    }
    d.setText(
      "log-status",
      (pre.textContent ? "" : "No output yet. ") +
        "rank " +
        lg.rank +
        ", attempt " +
        lg.attempt +
        ", " +
        d.fmtBytes(lg.offset) +
        " read" +
        (lg.eof && !isLive(job) ? " (end of log)" : ""),
    );
  }

  /* ---------- the poll loop ---------- */

  let ticks = 0;
  async function tick() {
    ticks += 1;
    let res;
    try {
      res = await d.api(base, { etag: view.etag });
    } catch (err) {
      if (err.status === 404) {
        $("not-found").hidden = false;
        $("job-body").hidden = true; // nothing of a job that is not there (or not yours)
        $("clone-link").hidden = true;
        poller.stop();
        return false;
      }
      throw err;
    }
    const changed = res.status !== 304;
    if (changed) {
      view.etag = res.etag;
      view.job = res.body;
    }
    const job = view.job;
    const live = isLive(job);
    if (!changed && !live && view.drained) {
      renderJob(job); // run time and ages
      return false;
    }
    renderJob(job);
    await refreshEvents(job);
    await refreshGoodput(job);
    const metricsChanged = await charts.refresh(changed || ticks % 3 === 1);
    await refreshLog(job);
    await refreshCheckpoints(job);
    document.body.dataset.loaded = "1";
    view.drained = !live && !metricsChanged && (view.log.eof || job.state === "cancelled" || !job.started_at);
    return live || !view.drained;
  }

  const poller = new d.Poller(tick, 1500, 30000);

  $("cancel-button").addEventListener("click", () => {
    $("cancel-confirm").hidden = false;
    $("cancel-button").hidden = true;
    $("cancel-yes").focus();
  });
  $("cancel-no").addEventListener("click", () => {
    $("cancel-confirm").hidden = true;
    $("cancel-button").hidden = false;
  });
  $("cancel-yes").addEventListener("click", async () => {
    $("cancel-yes").disabled = true;
    try {
      const res = await d.api(base + "/cancel", { method: "POST" });
      view.job = res.body;
      view.etag = null;
      renderJob(view.job);
    } catch (err) {
      d.showBanner("Cancel failed: " + (typeof err.detail === "string" ? err.detail : err.message), "error");
    } finally {
      $("cancel-yes").disabled = false;
      $("cancel-confirm").hidden = true;
      $("cancel-button").hidden = false;
      poller.now();
    }
  });
  $("log-scale").addEventListener("change", (ev) => {
    charts.setLogScale(ev.target.checked);
  });
  $("x-axis").addEventListener("change", (ev) => {
    charts.setXAxis(ev.target.value);
  });
  $("smoothing").addEventListener("change", (ev) => {
    charts.setSmoothing(Number(ev.target.value));
  });
  $("log-rank").addEventListener("change", (ev) => {
    switchLog(Number(ev.target.value), view.log.attempt);
    poller.now();
  });
  $("log-attempt").addEventListener("change", (ev) => {
    view.log.userPickedAttempt = Number(ev.target.value) !== (view.job && view.job.attempt);
    switchLog(view.log.rank, Number(ev.target.value));
    poller.now();
  });

  poller.start();
})();
