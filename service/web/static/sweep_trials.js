/* ddpq dashboard: a sweep page's trials table, one page at a time, sorted and paged on the
 * server (GET /sweeps/<id>/trials?sort=&order=&limit=&offset=), so 10,000 trials cost one
 * page of rows. A header click sorts by that column on the server (the objective's value,
 * an override's, …; missing values last either way); Previous/Next move by a page. Each row
 * has a box that adds its trial's curve to the chart (onPick). Rows the delta poll brings
 * (held(key)) update the page in place; a sort by a changing column reloads the page. */
"use strict";

(function () {
  const d = window.ddpq;
  const s = window.ddpqSweeps;
  const PAGE_SIZE = 50;
  const $ = (id) => document.getElementById(id);
  // The page's column keys and the API's sort names; "axis:<path>" sorts by "overrides.<path>".
  const SORT_NAMES = {
    position: "position",
    job: "job_id",
    outcome: "outcome",
    objective: "objective_value",
    steps: "steps_done",
    attempts: "attempts",
    run_time: "run_time_s",
  };
  // Columns whose values do not change as trials run: a delta updates their page in place.
  const STATIC = ["position", "job"];
  // Numeric columns that change only with the trial's row (the delta poll brings them).
  const MERGEABLE = ["objective", "steps", "attempts"];
  // (An override's value does not change either; "axis:" columns count as static.)

  /* ``opts``: base ("sweeps/<id>"), sweep() (the sweep as last polled), axisPaths(),
   * isBest(trial), held(key) (the newest row of a trial, from any answer), picked (a Set of
   * job ids), onRows(rows) (rows of each answer), onPick(). */
  function trialsTable(opts) {
    const state = { sort: { key: "position", dir: 1 }, offset: 0, rows: [], total: 0, headKey: null };

    function apiSort() {
      const key = state.sort.key;
      const name = key.startsWith("axis:") ? "overrides." + key.slice(5) : SORT_NAMES[key];
      return { sort: name || "position", order: state.sort.dir > 0 ? "asc" : "desc" };
    }

    function columns() {
      const cols = [
        {
          key: "pick",
          label: "Curve",
          sortable: false,
          cell: (t) => {
            const box = d.el("input", {
              type: "checkbox",
              class: "pick",
              "data-job-id": t.job_id || "",
              "aria-label": "Draw trial " + t.position + "'s curve",
              title: "Draw this trial's curve",
            });
            box.checked = Boolean(t.job_id) && opts.picked.has(t.job_id);
            box.disabled = !t.job_id;
            return d.el("td", { class: "pick" }, box);
          },
        },
        { key: "position", label: "Trial", cell: (t) => d.el("td", { class: "num" }, t.position) },
        {
          key: "job",
          label: "Job",
          cell: (t) => d.el("td", { class: "num" }, t.job_id ? d.el("a", { href: "/jobs/" + t.job_id }, "#" + t.job_id) : "–"),
        },
        { key: "outcome", label: "Outcome", cell: (t) => d.el("td", null, d.badge(t.outcome)) },
      ];
      for (const path of opts.axisPaths()) {
        cols.push({
          key: "axis:" + path,
          label: path,
          cell: (t) => d.el("td", { class: "num mono", "data-axis": path }, s.valueText((t.overrides || {})[path])),
        });
      }
      const sweep = opts.sweep();
      const metric = (sweep && sweep.objective && sweep.objective.metric) || "objective";
      cols.push(
        {
          key: "objective",
          label: metric,
          cell: (t) => d.el("td", { class: "num objective" }, t.objective_value === null ? "–" : d.fmtValue(t.objective_value)),
        },
        { key: "steps", label: "Steps", cell: (t) => d.el("td", { class: "num" }, t.steps_done === null ? "–" : t.steps_done) },
        { key: "attempts", label: "Jobs", cell: (t) => d.el("td", { class: "num opt" }, t.attempts) },
        { key: "run_time", label: "Run time", cell: (t) => d.el("td", { class: "num opt" }, d.fmtDuration(t.run_time_s)) },
      );
      return cols;
    }

    function renderHead(head, cols, headKey) {
      state.headKey = headKey;
      const active = document.activeElement;
      const focused = active && head.contains(active) && active.closest("th") ? active.closest("th").dataset.key : null;
      d.clear(head);
      for (const col of cols) {
        if (col.sortable === false) {
          head.append(d.el("th", { class: "pick", "data-key": col.key }, col.label));
          continue;
        }
        const sorted = state.sort.key === col.key;
        const th = d.el(
          "th",
          { "data-key": col.key, "aria-sort": sorted ? (state.sort.dir > 0 ? "ascending" : "descending") : "none" },
          d.el("button", { type: "button", class: "sort", title: "Sort by " + col.label }, col.label),
        );
        if (["attempts", "run_time"].includes(col.key)) th.classList.add("opt");
        head.append(th);
      }
      if (focused) {
        const again = head.querySelector('th[data-key="' + CSS.escape(focused) + '"] button');
        if (again) again.focus();
      }
    }

    /* Draw the held page; each row as the newest answer has it. */
    function render() {
      const cols = columns();
      const head = $("trials-head");
      // The header is rebuilt only when its columns or the sort change, so a focused header
      // button keeps its focus across polls (and across its own click).
      const headKey = JSON.stringify([cols.map((c) => c.key), state.sort]);
      if (headKey !== state.headKey) renderHead(head, cols, headKey);
      const body = $("trials-body");
      d.clear(body);
      for (const row of state.rows) {
        const t = opts.held(row.key) || row;
        const tr = d.el("tr", { "data-key": t.key, "data-job-id": t.job_id, "data-outcome": t.outcome });
        if (opts.isBest(t)) {
          tr.classList.add("best");
          tr.title = "The best trial by the sweep's objective";
        }
        for (const c of cols) tr.append(c.cell(t));
        body.append(tr);
      }
      const from = state.rows.length ? state.offset + 1 : 0;
      d.setText("trials-range", from + "–" + (state.offset + state.rows.length) + " of " + state.total);
      $("trials-prev").disabled = state.offset === 0;
      $("trials-next").disabled = state.offset + state.rows.length >= state.total;
      $("trials-table").dataset.total = String(state.total);
      $("trials-table").dataset.offset = String(state.offset);
    }

    /* Fetch the page at ``state.offset`` in the current order and draw it. An answer that
     * comes after a newer load was asked for (two sorts in a row) is dropped: it is of the
     * order or page the table no longer shows. */
    let loads = 0;
    async function load() {
      const q = new URLSearchParams(apiSort());
      q.set("limit", String(PAGE_SIZE));
      q.set("offset", String(state.offset));
      const mine = ++loads;
      const body = (await d.api(opts.base + "/trials?" + q.toString())).body;
      if (mine !== loads) return;
      state.rows = body.trials || [];
      state.total = Number(body.total) || 0;
      opts.onRows(state.rows);
      render();
    }

    /* The value a row sorts by (the API's column), null when it has none. */
    function sortValue(t) {
      const key = state.sort.key;
      const v = key.startsWith("axis:") ? (t.overrides || {})[key.slice(5)] : t[SORT_NAMES[key] || "position"];
      return v === undefined ? null : v;
    }

    /* Whether a trial whose sort value was ``v`` sorts at or before the page's last row:
     * only such a trial can move rows of this page (missing values sort last). */
    function reaches(v) {
      const last = state.rows[state.rows.length - 1];
      const atEnd = state.offset + state.rows.length >= state.total;
      if (!last || v === null) return atEnd;
      const w = sortValue(last);
      if (w === null || typeof v !== typeof w) return true; // mixed types: ask the server
      return state.sort.dir > 0 ? v <= w : v >= w;
    }

    /* The server's order of two rows: by sort value (``dir``), ties in position order. */
    function sortsBefore(a, b) {
      const va = sortValue(a);
      const vb = sortValue(b);
      if (va !== vb) return state.sort.dir > 0 ? va < vb : va > vb;
      return a.position < b.position;
    }

    /* The first page after a delta poll, from the rows already held, when that is exact;
     * null when only the server can tell. Every trial off the page sorted after its last row
     * (``last``) before the poll, and those that changed and may now sort before it are in
     * ``changed``; so if the page's rows and those, re-sorted, fill the page up to a row
     * that still sorts no later than ``last``, no other trial can belong on it. A trial
     * that got worse past the last row leaves a gap only the server can fill. MERGEABLE
     * columns only (a running trial's run time grows without its row changing, so the poll
     * does not bring it); mixed or missing values ask the server. */
    function mergedFirstPage(changed) {
      const last = state.rows[state.rows.length - 1];
      if (state.offset !== 0 || !last || !MERGEABLE.includes(state.sort.key)) return null;
      const rows = new Map(state.rows.map((t) => [t.key, opts.held(t.key) || t]));
      for (const t of changed) if (rows.has(t.key) || reaches(sortValue(t))) rows.set(t.key, t);
      const merged = [...rows.values()];
      if (!merged.every((t) => typeof sortValue(t) === "number") || typeof sortValue(last) !== "number") {
        return null;
      }
      merged.sort((a, b) => (sortsBefore(a, b) ? -1 : sortsBefore(b, a) ? 1 : 0));
      const full = state.rows.length >= PAGE_SIZE;
      const page = merged.slice(0, PAGE_SIZE);
      if (!full) return page.length === state.rows.length ? page : null; // every trial was on it
      const end = page[page.length - 1];
      return page.length === PAGE_SIZE && !sortsBefore(last, end) ? page : null;
    }

    /* After a delta poll (``changed``: the trials it brought; ``before``: trial key → the row
     * held before it): when trials were added or one of them may have moved into, out of or
     * within the page, re-sort the first page from what is held when that is exact
     * (``mergedFirstPage``: a live sweep's improving trials), else reload the page; when no
     * row moved, redraw the rows it holds from the newest answers. */
    async function update(changed, before, total) {
      const onPage = new Set(state.rows.map((t) => t.key));
      const moves =
        !STATIC.includes(state.sort.key) &&
        !state.sort.key.startsWith("axis:") &&
        changed.some((t) => {
          if (onPage.has(t.key) || reaches(sortValue(t))) return true;
          // Where it was before: unknown past the first page unless held (ask the server).
          if (!before.has(t.key)) return state.offset > 0;
          return reaches(sortValue(before.get(t.key)));
        });
      const merged = total === state.total && moves ? mergedFirstPage(changed) : null;
      if (merged) {
        state.rows = merged;
        render();
      } else if (total !== state.total || moves) await load();
      else if (changed.some((t) => onPage.has(t.key))) render();
    }

    async function sortBy(key) {
      state.sort = { key: key, dir: state.sort.key === key ? -state.sort.dir : 1 };
      state.offset = 0;
      render(); // the header at once (keeps its focus); the rows when they come
      await load();
    }

    $("trials-head").addEventListener("click", (ev) => {
      const th = ev.target instanceof Element ? ev.target.closest("th[data-key]") : null;
      if (!th || th.dataset.key === "pick") return;
      sortBy(th.dataset.key).catch((err) => d.showBanner("Could not sort: " + err.message, "error"));
    });
    $("trials-body").addEventListener("change", (ev) => {
      const box = ev.target;
      if (!(box instanceof HTMLInputElement) || !box.classList.contains("pick")) return;
      const id = Number(box.dataset.jobId);
      if (box.checked) opts.picked.add(id);
      else opts.picked.delete(id);
      opts.onPick();
    });
    for (const [id, step] of [["trials-prev", -1], ["trials-next", 1]]) {
      $(id).addEventListener("click", () => {
        state.offset = Math.max(0, state.offset + step * PAGE_SIZE);
        load().catch((err) => d.showBanner("Could not load trials: " + err.message, "error"));
      });
    }

    return { load: load, update: update, render: render, state: state };
  }

  window.ddpqSweepTrials = { trialsTable: trialsTable, PAGE_SIZE: PAGE_SIZE };
})();
