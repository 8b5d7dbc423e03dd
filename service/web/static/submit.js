/* ddpq dashboard: /submit — a built-in task from a form, or a pasted YAML/JSON spec.
 * The API validates; its 422 details ({loc: ["body", field, ...], msg}) are shown next to the
 * matching input, or listed with their field path. Success goes to the new job's page.
 * /submit?from=<id> ("clone and edit") fills both the form and the paste box from that job's
 * spec, and opens the paste tab when the spec sets something the form has no input for. */
"use strict";

(function () {
  const d = window.ddpq;
  const $ = (id) => document.getElementById(id);
  const form = $("task-form");
  const pasteForm = $("paste-form");
  const taskSelect = $("in-task");

  function newKey() {
    if (window.crypto && typeof window.crypto.randomUUID === "function") return window.crypto.randomUUID();
    return "web-" + Date.now() + "-" + Math.random().toString(16).slice(2);
  }

  // One Idempotency-Key per intended submission: a double click or a retry after a lost
  // response returns the same job; editing the form starts a new submission.
  let formKey = newKey();
  let pasteKey = newKey();
  form.addEventListener("input", () => {
    formKey = newKey();
  });
  $("spec-text").addEventListener("input", () => {
    pasteKey = newKey();
  });

  /* ---------- tabs ---------- */
  function selectTab(which) {
    const paste = which === "paste";
    $("tab-form").setAttribute("aria-selected", String(!paste));
    $("tab-paste").setAttribute("aria-selected", String(paste));
    $("form-pane").hidden = paste;
    $("paste-pane").hidden = !paste;
  }
  $("tab-form").addEventListener("click", () => selectTab("form"));
  $("tab-paste").addEventListener("click", () => selectTab("paste"));

  function showTaskConfig() {
    for (const fs of document.querySelectorAll("fieldset.task-config")) {
      const active = fs.dataset.task === taskSelect.value;
      fs.hidden = !active;
      fs.disabled = !active;
    }
  }
  // The name follows the task while it is still the generated "<task>-demo".
  let shownTask = taskSelect.value;
  taskSelect.addEventListener("change", () => {
    const name = $("in-name");
    if (name.value === shownTask + "-demo") name.value = taskSelect.value + "-demo";
    shownTask = taskSelect.value;
    showTaskConfig();
  });
  showTaskConfig();

  /* ---------- building the spec from the form ---------- */
  function setPath(obj, path, value) {
    const parts = path.split(".");
    let node = obj;
    for (const part of parts.slice(0, -1)) {
      if (!(part in node)) node[part] = {};
      node = node[part];
    }
    node[parts[parts.length - 1]] = value;
  }

  /* A form value as JSON: numbers where they parse, true/false for on/off, a list of the
   * comma-separated items; else the raw text so the server's message ("Input should be a
   * valid integer") reaches the user. Blank → omitted (the spec's default applies). */
  function convert(raw, kind) {
    const text = raw.trim();
    if (text === "") return undefined;
    if (kind === "int" && /^[+-]?\d+$/.test(text)) return Number(text);
    if (kind === "float" && text !== "" && Number.isFinite(Number(text))) return Number(text);
    if (kind === "bool" && (text === "true" || text === "false")) return text === "true";
    if (kind === "list") {
      const items = text.split(",").map((item) => item.trim()).filter((item) => item !== "");
      return items.length ? items : undefined;
    }
    return text;
  }

  function specFromForm() {
    const spec = { launcher: "local", config: {} };
    for (const input of form.querySelectorAll("[data-path]")) {
      if (!(input instanceof HTMLInputElement || input instanceof HTMLSelectElement)) continue;
      if (input.closest("fieldset:disabled")) continue;
      const value = input.dataset.kind ? convert(input.value, input.dataset.kind) : input.value;
      if (value === undefined) continue;
      setPath(spec, input.dataset.path, value);
    }
    return spec;
  }

  /* ---------- clone and edit: pre-filling from a job's spec ---------- */
  function valueAt(obj, path) {
    let node = obj;
    for (const part of path.split(".")) {
      if (node === null || typeof node !== "object" || !(part in node)) return undefined;
      node = node[part];
    }
    return node;
  }

  /* A spec value as the text its input shows (the inverse of convert). */
  function inputText(value) {
    if (value === null || value === undefined) return "";
    if (Array.isArray(value)) return value.join(", ");
    if (typeof value === "boolean") return value ? "true" : "false";
    return String(value);
  }

  function leaves(obj, prefix, out) {
    for (const [key, value] of Object.entries(obj || {})) {
      const path = prefix ? prefix + "." + key : key;
      if (value !== null && typeof value === "object" && !Array.isArray(value)) leaves(value, path, out);
      else out.push([path, value]);
    }
    return out;
  }

  /* Paths the spec sets, away from the spec's defaults, that the form has no input for (and
   * so would drop): e.g. nnodes, slurm, init_from. The task's config is all in the form. */
  function uncoveredPaths(spec) {
    const defaults = JSON.parse(form.dataset.specDefaults || "{}");
    const covered = new Set(["name", "task", "launcher"]);
    for (const input of form.querySelectorAll("[data-path]")) covered.add(input.dataset.path);
    return leaves(spec, "", []).filter(([path, value]) => {
      if (covered.has(path) || path.startsWith("config.")) return false;
      if (path === "launcher" && value === "local") return false;
      return JSON.stringify(value) !== JSON.stringify(valueAt(defaults, path));
    });
  }

  function fillForm(spec) {
    taskSelect.value = spec.task;
    shownTask = spec.task;
    showTaskConfig();
    for (const input of form.querySelectorAll("[data-path]")) {
      if (input === taskSelect) continue;
      const box = input.closest("fieldset.task-config");
      if (box && box.dataset.task !== spec.task) continue;
      const value = valueAt(spec, input.dataset.path);
      // A config field the spec leaves out keeps its default; every other field follows.
      if (value === undefined && input.dataset.path.startsWith("config.")) continue;
      input.value = inputText(value);
    }
    // Fault-injection knobs the cloned job set are shown, not left folded away.
    for (const details of form.querySelectorAll("fieldset.task-config:not([disabled]) details.fault-injection")) {
      const set = [...details.querySelectorAll("input[data-path]")].some((input) => {
        const value = valueAt(spec, input.dataset.path);
        return value !== undefined && value !== null && value !== 0;
      });
      if (set) details.open = true;
    }
  }

  async function prefill(jobId) {
    let job;
    try {
      job = (await d.api("jobs/" + encodeURIComponent(jobId))).body;
    } catch (err) {
      d.showBanner("Could not load job #" + jobId + " to clone: " + err.message, "error");
      return;
    }
    const spec = job.spec || {};
    $("spec-text").value = JSON.stringify(spec, null, 2) + "\n";
    const builtin = [...taskSelect.options].some((o) => o.value === spec.task);
    const missing = builtin ? uncoveredPaths(spec) : [];
    if (builtin) fillForm(spec);
    formKey = newKey();
    pasteKey = newKey();
    let note = "Cloned from job #" + job.id + " (" + job.name + "): edit, then submit.";
    if (!builtin || missing.length) {
      selectTab("paste");
      note += builtin
        ? " The spec sets " + missing.map((m) => m[0]).join(", ") + ", which the form has no input for, so it is shown as text."
        : " Its task is an entrypoint, so the spec is shown as text.";
    }
    const banner = $("clone-note");
    banner.textContent = note;
    banner.hidden = false;
    form.dataset.clonedFrom = String(job.id);
  }

  const cloneFrom = new URLSearchParams(window.location.search).get("from");
  if (cloneFrom && /^[1-9][0-9]{0,18}$/.test(cloneFrom)) prefill(cloneFrom);

  /* ---------- showing errors ---------- */
  function clearErrors(root) {
    for (const node of root.querySelectorAll("[data-error-for]")) node.textContent = "";
    for (const node of root.querySelectorAll(".field.invalid")) node.classList.remove("invalid");
    for (const list of root.querySelectorAll(".form-errors")) {
      d.clear(list);
      list.hidden = true;
    }
  }

  function errorPath(loc) {
    const parts = Array.isArray(loc) ? loc.slice() : [];
    if (parts[0] === "body") parts.shift();
    return parts.map(String).join(".");
  }

  function detailList(detail) {
    if (Array.isArray(detail)) return detail;
    return [{ loc: [], msg: typeof detail === "string" ? detail : JSON.stringify(detail) }];
  }

  /* The error slot for `path`, or for the nearest enclosing path the form has an input for
   * (an error at "tags.1" goes under the tags input, naming the item), with the rest of the
   * path; null when the form has no input for it. */
  function errorTarget(path) {
    const parts = path ? path.split(".") : [];
    for (let n = parts.length; n > 0; n--) {
      const at = parts.slice(0, n).join(".");
      const target = form.querySelector('[data-error-for="' + CSS.escape(at) + '"]');
      if (target && !target.closest("fieldset:disabled")) return { target, rest: parts.slice(n).join(".") };
    }
    return null;
  }

  /* Put each error next to its input when the form has one, else in the list. */
  function showFormErrors(detail) {
    const list = $("form-errors");
    let first = null;
    for (const err of detailList(detail)) {
      const path = errorPath(err.loc);
      const found = errorTarget(path);
      if (found) {
        const { target, rest } = found;
        // A list item's index is 0-based in the API; people count from 1.
        const where = /^\d+$/.test(rest) ? "item " + (Number(rest) + 1) : rest;
        const msg = where ? where + ": " + err.msg : err.msg;
        target.textContent = target.textContent ? target.textContent + "; " + msg : msg;
        const field = target.closest(".field");
        field.classList.add("invalid");
        if (!first) first = field.querySelector("input, select");
      } else {
        list.append(d.el("li", null, (path ? path + ": " : "") + err.msg));
        list.hidden = false;
      }
    }
    if (first) first.focus();
  }

  function showPasteErrors(detail) {
    const list = $("paste-errors");
    for (const err of detailList(detail)) {
      const path = errorPath(err.loc);
      list.append(d.el("li", { "data-path": path }, (path && path !== "text" ? path + ": " : "") + err.msg));
    }
    list.hidden = false;
    $("spec-text").closest(".field").classList.add("invalid");
  }

  /* ---------- preview: what would run (POST /jobs?dry_run=true, nothing stored) ---------- */
  function showPreview(answer) {
    const warnings = $("preview-warnings");
    d.clear(warnings);
    for (const w of answer.warnings) warnings.append(d.el("li", null, "Warning: " + w));
    warnings.hidden = !answer.warnings.length;
    const q = answer.queue;
    const lines = ["Queue: " + q.summary];
    for (const w of q.workers) {
      const verdict = w.can_now ? "can run it now" : (w.can_ever ? "not now: " : "never: ") + w.why_not.join("; ");
      lines.push("Worker " + w.id + " (" + w.launcher + "): " + verdict + w.notes.map((n) => " — " + n).join(""));
    }
    d.setText("preview-queue", lines.join("\n"));
    const plans = $("preview-plans");
    d.clear(plans);
    for (const plan of answer.plans) {
      plans.append(d.el("h3", null, "Launch plan (" + plan.launcher + ")"));
      plans.append(plan.error ? d.el("p", { class: "field-error" }, plan.error) : d.el("pre", { class: "plan" }, plan.text));
    }
    $("preview").hidden = false;
  }

  async function preview(spec) {
    const res = await d.api("jobs?dry_run=true", { method: "POST", json: spec });
    showPreview(res.body);
  }

  $("preview-form").addEventListener("click", () => {
    guarded($("preview-form"), async () => {
      clearErrors(form);
      try {
        await preview(specFromForm());
      } catch (err) {
        $("preview").hidden = true;
        if (err.status === 422 || err.status === 400) showFormErrors(err.detail);
        else d.showBanner("Preview failed: " + err.message, "error");
      }
    });
  });

  $("preview-paste").addEventListener("click", () => {
    guarded($("preview-paste"), async () => {
      clearErrors(pasteForm);
      try {
        const parsed = await d.api("/submit/parse-spec", { method: "POST", json: { text: $("spec-text").value } });
        await preview(parsed.body.spec);
      } catch (err) {
        $("preview").hidden = true;
        if (err.status === 422 || err.status === 400) showPasteErrors(err.detail);
        else d.showBanner("Preview failed: " + err.message, "error");
      }
    });
  });

  /* ---------- submitting ---------- */
  async function post(spec, key) {
    const res = await d.api("jobs", { method: "POST", json: spec, headers: { "Idempotency-Key": key } });
    window.location.assign("/jobs/" + res.body.id);
  }

  async function guarded(button, work) {
    if (button.disabled) return;
    button.disabled = true;
    d.showBanner(null);
    try {
      await work();
    } finally {
      button.disabled = false;
    }
  }

  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    guarded($("submit-form"), async () => {
      clearErrors(form);
      try {
        await post(specFromForm(), formKey);
      } catch (err) {
        if (err.status === 422 || err.status === 400) showFormErrors(err.detail);
        else d.showBanner("Submit failed: " + err.message, "error");
      }
    });
  });

  pasteForm.addEventListener("submit", (ev) => {
    ev.preventDefault();
    guarded($("submit-paste"), async () => {
      clearErrors(pasteForm);
      $("spec-text").closest(".field").classList.remove("invalid");
      try {
        const parsed = await d.api("/submit/parse-spec", {
          method: "POST",
          json: { text: $("spec-text").value },
        });
        await post(parsed.body.spec, pasteKey);
      } catch (err) {
        if (err.status === 422 || err.status === 400) showPasteErrors(err.detail);
        else d.showBanner("Submit failed: " + err.message, "error");
      }
    });
  });
})();
