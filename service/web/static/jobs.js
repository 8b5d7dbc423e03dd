/* ddpq dashboard: the job list (/) — filter by state, newest first, cursor paging, live polling. */
"use strict";

(function () {
  const d = window.ddpq;
  const PAGE_SIZE = 25;
  const body = document.getElementById("jobs-body");
  const empty = document.getElementById("jobs-empty");
  const filter = document.getElementById("state-filter");
  const olderButton = document.getElementById("page-older");
  const newestButton = document.getElementById("page-newest");
  const pollStatus = document.getElementById("poll-status");

  const params = new URLSearchParams(window.location.search);
  const view = {
    state: params.get("state") || "",
    cursor: params.get("cursor") || "",
    nextCursor: null,
    etag: null,
  };
  filter.value = view.state;

  function syncUrl() {
    const q = new URLSearchParams();
    if (view.state) q.set("state", view.state);
    if (view.cursor) q.set("cursor", view.cursor);
    const search = q.toString();
    window.history.replaceState(null, "", search ? "?" + search : window.location.pathname);
  }

  function progressCell(job) {
    const p = d.describeProgress(job.progress, job.state);
    const bar = d.el("div", { class: "bar" });
    bar.style.width = (p.fraction * 100).toFixed(1) + "%";
    if (job.state === "succeeded") bar.classList.add("done");
    if (job.state === "failed") bar.classList.add("failed");
    const label = p.total > 0 ? p.step + " / " + p.total : p.step > 0 ? "step " + p.step : "";
    return d.el(
      "td",
      { class: "progress-cell", title: p.text || "no progress reported" },
      d.el("div", { class: "progress" }, bar),
      d.el("span", { class: "eta" }, [label, p.eta].filter(Boolean).join(" · ") || "\u00a0"),
    );
  }

  function row(job) {
    const loss = d.latestValue(job.latest_metrics, "loss");
    const link = d.el("a", { href: "/jobs/" + job.id, class: "job-link" }, job.name);
    const nameCell = d.el(
      "td",
      { class: "name" },
      link,
      d.el(
        "span",
        { class: "sub" },
        "#" + job.id + (job.cancel_requested && d.LIVE_STATES.includes(job.state) ? " · cancelling" : ""),
      ),
    );
    return d.el(
      "tr",
      { "data-job-id": job.id, "data-state": job.state },
      nameCell,
      d.el("td", { class: "opt" }, job.owner),
      d.el("td", null, d.badge(job.state)),
      progressCell(job),
      d.el("td", { class: "num" }, d.fmtValue(loss)),
      d.el("td", { class: "opt num" }, job.attempt),
      d.el(
        "td",
        { class: "opt num age", title: job.created_at, "data-time": job.created_at },
        d.fmtAge(job.created_at),
      ),
      d.el("td", { class: "opt" }, job.launcher || (job.spec && job.spec.launcher) || "–"),
    );
  }

  function render(envelope) {
    const jobs = envelope.jobs || [];
    d.clear(body);
    for (const job of jobs) body.append(row(job));
    empty.hidden = jobs.length > 0;
    if (!jobs.length && (view.state || view.cursor)) {
      empty.textContent = "No " + (view.state || "") + " jobs on this page.";
    }
    view.nextCursor = envelope.next_cursor || null;
    olderButton.disabled = !view.nextCursor;
    newestButton.disabled = !view.cursor;
    return jobs.some((job) => d.LIVE_STATES.includes(job.state));
  }

  let live = false;
  async function tick() {
    const q = new URLSearchParams({ limit: String(PAGE_SIZE) });
    if (view.state) q.set("state", view.state);
    if (view.cursor) q.set("cursor", view.cursor);
    const res = await d.api("jobs?" + q.toString(), { etag: view.etag });
    if (res.status !== 304) {
      view.etag = res.etag;
      live = render(res.body);
    } else {
      // Unchanged data: only the ages move on (the rows, and any focus in them, stay).
      for (const cell of body.querySelectorAll("td.age")) d.setText(cell, d.fmtAge(cell.dataset.time));
    }
    // Filtering on a terminal state: nothing on the page can change, but new jobs may appear
    // on the first page, so keep polling slowly.
    pollStatus.textContent = live ? "Live: refreshing every 2 s." : "Nothing running; refreshing less often.";
    return live;
  }

  const poller = new d.Poller(tick, 2000, 30000);

  function reload() {
    view.etag = null;
    syncUrl();
    poller.now();
  }

  filter.addEventListener("change", () => {
    view.state = filter.value;
    view.cursor = "";
    reload();
  });
  olderButton.addEventListener("click", () => {
    if (!view.nextCursor) return;
    view.cursor = String(view.nextCursor);
    reload();
  });
  newestButton.addEventListener("click", () => {
    view.cursor = "";
    reload();
  });

  poller.start();
})();
