/* ddpq dashboard: the job list (/) — filter by state and by name/tag (the API's q=), newest
 * first, cursor paging, live polling. Each row's metric is the API's main_metric_value.
 * Each row's checkbox picks the job for the compare page; the picks outlive re-renders and
 * paging (kept here, in page order of picking). */
"use strict";

(function () {
  const d = window.ddpq;
  const PAGE_SIZE = 25;
  const body = document.getElementById("jobs-body");
  const empty = document.getElementById("jobs-empty");
  const filter = document.getElementById("state-filter");
  const textFilter = document.getElementById("text-filter");
  const olderButton = document.getElementById("page-older");
  const newestButton = document.getElementById("page-newest");
  const pollStatus = document.getElementById("poll-status");
  const compareLink = document.getElementById("compare-link");
  const picked = [];

  const params = new URLSearchParams(window.location.search);
  const view = {
    state: params.get("state") || "",
    q: params.get("q") || "",
    cursor: params.get("cursor") || "",
    nextCursor: null,
    etag: null,
  };
  filter.value = view.state;
  textFilter.value = view.q;

  function syncUrl() {
    const q = new URLSearchParams();
    if (view.state) q.set("state", view.state);
    if (view.q) q.set("q", view.q);
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

  /* Seconds from started_at to finished_at, or to now while the job has not finished;
   * null before it started. */
  function durationS(started, finished) {
    const from = d.parseTime(started);
    if (from === null) return null;
    const to = d.parseTime(finished);
    return Math.max(0, ((to === null ? Date.now() : to) - from) / 1000);
  }

  function durationCell(job) {
    const s = durationS(job.started_at, job.finished_at);
    const attrs = { class: "opt num duration", "data-started": job.started_at || "" };
    if (job.finished_at) attrs["data-finished"] = job.finished_at;
    else if (job.started_at) attrs.title = "running since " + d.fmtTime(job.started_at);
    return d.el("td", attrs, s === null ? "–" : d.fmtDuration(s));
  }

  function tagsCell(job) {
    const tags = (job.spec && Array.isArray(job.spec.tags) && job.spec.tags) || [];
    const cell = d.el("td", { class: "opt tags" });
    for (const tag of tags) {
      cell.append(d.el("button", { type: "button", class: "tag", "data-tag": tag, title: "Show jobs tagged " + tag }, tag));
    }
    if (!tags.length) cell.append("–");
    return cell;
  }

  function metricCell(job) {
    const name = job.main_metric || "loss";
    // main_metric_value is null both before the first report and for a NaN: latest_metrics
    // tells the two apart.
    const reported = Boolean(job.latest_metrics) && name in job.latest_metrics;
    return d.el(
      "td",
      { class: "num metric", "data-metric": name, title: name },
      reported ? d.fmtValue(d.latestValue(job.latest_metrics, name)) : "–",
      d.el("span", { class: "sub" }, name),
    );
  }

  function syncCompare() {
    compareLink.hidden = picked.length === 0;
    compareLink.textContent = "Compare " + picked.length + (picked.length === 1 ? " job" : " jobs");
    const ready = picked.length >= 2;
    compareLink.setAttribute("aria-disabled", ready ? "false" : "true");
    compareLink.classList.toggle("primary", ready);
    compareLink.href = "/compare?jobs=" + picked.join(",");
    compareLink.title = ready ? "Overlay these jobs' curves and list where their specs differ" : "Pick one more job";
  }

  function pickCell(job) {
    const box = d.el("input", {
      type: "checkbox",
      class: "pick",
      "data-job-id": job.id,
      "aria-label": "Pick job " + job.id + " to compare",
      checked: picked.includes(job.id),
    });
    return d.el("td", { class: "pick" }, box);
  }

  function row(job) {
    const link = d.el("a", { href: "/jobs/" + job.id, class: "job-link" }, job.name);
    const nameCell = d.el(
      "td",
      { class: "name" },
      link,
      d.el(
        "span",
        { class: "sub" },
        "#" + job.id + (job.cancel_requested && d.LIVE_STATES.includes(job.state) ? " · cancelling" : ""),
        job.sweep_id ? " · " : null,
        job.sweep_id ? d.el("a", { href: "/sweeps/" + job.sweep_id, class: "sweep-link" }, "sweep #" + job.sweep_id) : null,
      ),
    );
    return d.el(
      "tr",
      { "data-job-id": job.id, "data-state": job.state },
      pickCell(job),
      nameCell,
      d.el("td", { class: "opt task" }, (job.spec && job.spec.task) || "–"),
      tagsCell(job),
      d.el("td", { class: "opt" }, job.owner),
      d.el("td", null, d.badge(job.state)),
      progressCell(job),
      metricCell(job),
      durationCell(job),
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
    if (!jobs.length && (view.state || view.q || view.cursor)) {
      empty.textContent =
        "No " + (view.state ? view.state + " " : "") + "jobs" + (view.q ? " matching “" + view.q + "”" : "") + " on this page.";
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
    if (view.q) q.set("q", view.q);
    if (view.cursor) q.set("cursor", view.cursor);
    const res = await d.api("jobs?" + q.toString(), { etag: view.etag });
    if (res.status !== 304) {
      view.etag = res.etag;
      live = render(res.body);
    } else {
      // Unchanged data: only the ages move on (the rows, and any focus in them, stay).
      for (const cell of body.querySelectorAll("td.age")) d.setText(cell, d.fmtAge(cell.dataset.time));
      for (const cell of body.querySelectorAll("td.duration[data-started]:not([data-finished])")) {
        const s = durationS(cell.dataset.started, null);
        if (s !== null) d.setText(cell, d.fmtDuration(s));
      }
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
  // Typing filters after a short pause, not per keystroke (each change is a server query).
  let typing = null;
  function applyText(text) {
    const q = text.trim();
    if (q === view.q) return;
    view.q = q;
    view.cursor = "";
    reload();
  }
  textFilter.addEventListener("input", () => {
    window.clearTimeout(typing);
    typing = window.setTimeout(() => applyText(textFilter.value), 300);
  });
  textFilter.addEventListener("keydown", (ev) => {
    if (ev.key !== "Enter") return;
    window.clearTimeout(typing);
    applyText(textFilter.value);
  });
  body.addEventListener("change", (ev) => {
    const box = ev.target;
    if (!(box instanceof HTMLInputElement) || !box.classList.contains("pick")) return;
    const id = Number(box.dataset.jobId);
    const at = picked.indexOf(id);
    if (box.checked && at < 0) picked.push(id);
    if (!box.checked && at >= 0) picked.splice(at, 1);
    syncCompare();
  });
  compareLink.addEventListener("click", (ev) => {
    if (picked.length < 2) ev.preventDefault();
  });
  body.addEventListener("click", (ev) => {
    const tag = ev.target instanceof Element ? ev.target.closest("button.tag") : null;
    if (!tag) return;
    textFilter.value = tag.dataset.tag;
    window.clearTimeout(typing);
    applyText(tag.dataset.tag);
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
