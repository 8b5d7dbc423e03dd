/* ddpq dashboard: the sweep list (/sweeps) — newest first, cursor paging, each sweep's
 * counts by outcome and its best trial; polls while a sweep runs. */
"use strict";

(function () {
  const d = window.ddpq;
  const s = window.ddpqSweeps;
  const PAGE_SIZE = 25;
  const body = document.getElementById("sweeps-body");
  const olderButton = document.getElementById("page-older");
  const newestButton = document.getElementById("page-newest");
  const view = { cursor: "", nextCursor: null };

  function bestCell(sweep) {
    const cell = d.el("td", { class: "num best" });
    if (sweep.best) {
      cell.append(
        d.fmtValue(sweep.best.value),
        " ",
        sweep.best.job_id ? d.el("a", { href: "/jobs/" + sweep.best.job_id }, "#" + sweep.best.job_id) : null,
        sweep.best.outcome === "running" ? " (running)" : "",
      );
    } else {
      cell.append("–");
    }
    cell.append(d.el("span", { class: "sub" }, s.objectiveText(sweep.objective)));
    return cell;
  }

  function row(sweep) {
    return d.el(
      "tr",
      { "data-sweep-id": sweep.id, "data-state": sweep.state },
      d.el(
        "td",
        { class: "name" },
        d.el("a", { href: "/sweeps/" + sweep.id, class: "sweep-link" }, sweep.name),
        d.el("span", { class: "sub" }, "#" + sweep.id),
      ),
      d.el("td", null, d.badge(sweep.state)),
      d.el("td", { class: "trials" }, d.el("span", { class: "total" }, sweep.trials_total + " trials "), s.countBadges(sweep.counts)),
      bestCell(sweep),
      d.el("td", { class: "opt" }, sweep.owner),
      d.el("td", { class: "opt num age", title: sweep.created_at }, d.fmtAge(sweep.created_at)),
    );
  }

  async function tick() {
    const q = new URLSearchParams({ limit: String(PAGE_SIZE) });
    if (view.cursor) q.set("cursor", view.cursor);
    const res = await d.api("sweeps?" + q.toString());
    const sweeps = res.body.sweeps || [];
    d.clear(body);
    for (const sweep of sweeps) body.append(row(sweep));
    document.getElementById("sweeps-empty").hidden = sweeps.length > 0;
    view.nextCursor = res.body.next_cursor || null;
    olderButton.disabled = !view.nextCursor;
    newestButton.disabled = !view.cursor;
    const live = sweeps.some((sweep) => s.SWEEP_LIVE.includes(sweep.state));
    d.setText("poll-status", live ? "Live: refreshing every 2 s." : "Nothing running; refreshing less often.");
    document.body.dataset.loaded = "1";
    return live;
  }

  const poller = new d.Poller(tick, 2000, 30000);
  olderButton.addEventListener("click", () => {
    if (!view.nextCursor) return;
    view.cursor = String(view.nextCursor);
    poller.now();
  });
  newestButton.addEventListener("click", () => {
    view.cursor = "";
    poller.now();
  });
  poller.start();
})();
