/* ddpq dashboard: /workers — each worker's capacity, running jobs and heartbeat age. Live
 * workers only unless "show stopped" is ticked (the API's reaper deletes stopped workers'
 * rows after DDPQ_WORKER_RETENTION_S, 7 days by default). */
"use strict";

(function () {
  const d = window.ddpq;
  const body = document.getElementById("workers-body");
  const empty = document.getElementById("workers-empty");
  const noneLive = document.getElementById("workers-none-live");
  const showStopped = document.getElementById("show-stopped");
  const params = new URLSearchParams(window.location.search);
  showStopped.checked = params.get("stopped") === "1";
  let latest = [];
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
    // The API's status when it sends one: "lost" once it no longer hears from the worker.
    const stale = w.status ? w.status === "lost" : age > STALE_AFTER_S;
    return d.el(
      "td",
      { title: w.heartbeat_at },
      d.el("span", { class: "badge " + (stale ? "stale" : "ok") }, stale ? "lost" : "live"),
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

  function render() {
    const stopped = latest.filter((w) => w.stopped_at).length;
    const shown = showStopped.checked ? latest : latest.filter((w) => !w.stopped_at);
    d.clear(body);
    for (const w of shown) body.append(row(w));
    empty.hidden = latest.length > 0;
    noneLive.hidden = !(latest.length > 0 && !shown.length);
    d.setText("stopped-count", stopped ? "(" + stopped + ")" : "");
  }

  async function tick() {
    const res = await d.api("workers");
    latest = res.body.workers || [];
    render();
    d.setText("poll-status", "Refreshed " + new Date().toLocaleTimeString() + ".");
    return latest.some((w) => !w.stopped_at);
  }

  showStopped.addEventListener("change", () => {
    const q = new URLSearchParams(window.location.search);
    if (showStopped.checked) q.set("stopped", "1");
    else q.delete("stopped");
    const search = q.toString();
    window.history.replaceState(null, "", search ? "?" + search : window.location.pathname);
    render();
  });

  new d.Poller(tick, 5000, 30000).start();
})();
