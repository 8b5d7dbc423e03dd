/* ddpq dashboard: /workers — each worker's capacity, running jobs and heartbeat age. */
"use strict";

(function () {
  const d = window.ddpq;
  const body = document.getElementById("workers-body");
  const empty = document.getElementById("workers-empty");
  // A heartbeat older than this many seconds is shown as stale (the default lease is 30 s).
  const STALE_AFTER_S = 30;

  function capacityText(capacity) {
    const c = capacity || {};
    const gpus = Array.isArray(c.gpus) ? c.gpus : c.gpus ? [c.gpus] : [];
    return (
      (c.slots === undefined ? "?" : c.slots) +
      " slot" +
      (c.slots === 1 ? "" : "s") +
      (gpus.length ? " · GPUs " + gpus.join(", ") : " · no GPUs")
    );
  }

  function heartbeatCell(w) {
    if (w.stopped_at) {
      return d.el(
        "td",
        { title: w.stopped_at },
        d.el("span", { class: "badge stopped" }, "stopped"),
        " ",
        d.fmtAge(w.stopped_at),
      );
    }
    const age =
      w.heartbeat_age_s !== undefined && w.heartbeat_age_s !== null
        ? Number(w.heartbeat_age_s)
        : (Date.now() - (d.parseTime(w.heartbeat_at) || 0)) / 1000;
    const stale = age > STALE_AFTER_S;
    return d.el(
      "td",
      { title: w.heartbeat_at },
      d.el("span", { class: "badge " + (stale ? "stale" : "ok") }, stale ? "stale" : "alive"),
      " " + d.fmtDuration(age) + " ago",
    );
  }

  function row(w) {
    const jobs = d.el("td");
    const running = w.running_jobs || [];
    running.forEach((id, i) => {
      if (i) jobs.append(", ");
      jobs.append(d.el("a", { href: "/jobs/" + id }, "#" + id));
    });
    if (!running.length) jobs.append("–");
    return d.el(
      "tr",
      { "data-worker-id": w.id },
      d.el("td", { class: "name" }, w.id),
      d.el("td", { class: "opt" }, w.host),
      d.el("td", { class: "opt num" }, w.pid),
      d.el("td", { class: "opt" }, w.launcher),
      d.el("td", null, capacityText(w.capacity)),
      jobs,
      heartbeatCell(w),
      d.el("td", { class: "opt", title: w.started_at }, d.fmtAge(w.started_at)),
    );
  }

  async function tick() {
    const res = await d.api("workers");
    const workers = res.body.workers || [];
    d.clear(body);
    for (const w of workers) body.append(row(w));
    empty.hidden = workers.length > 0;
    d.setText("poll-status", "Refreshed " + new Date().toLocaleTimeString() + ".");
    return workers.some((w) => !w.stopped_at);
  }

  new d.Poller(tick, 5000, 30000).start();
})();
