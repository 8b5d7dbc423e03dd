/* ddpq dashboard: shared helpers (API calls, DOM building with textContent, formatting, polling).
 * Every page script uses window.ddpq; nothing here writes HTML strings, so user data is always text. */
"use strict";

(function () {
  const API = "/api/v1";
  const LIVE_STATES = ["queued", "starting", "running"];
  const TERMINAL_STATES = ["succeeded", "failed", "cancelled"];

  class ApiError extends Error {
    constructor(status, detail) {
      super(typeof detail === "string" ? detail : "HTTP " + status);
      this.status = status;
      this.detail = detail;
    }
  }

  /* The API token lives in sessionStorage only: this tab, gone when it closes, never a
   * cookie (which the browser would attach to other sites' requests to us). */
  const TOKEN_KEY = "ddpq.token";

  function storedToken() {
    try {
      return window.sessionStorage.getItem(TOKEN_KEY);
    } catch (_e) {
      return null;
    }
  }

  function storeToken(token) {
    try {
      if (token) window.sessionStorage.setItem(TOKEN_KEY, token);
      else window.sessionStorage.removeItem(TOKEN_KEY);
    } catch (_e) {
      /* storage disabled: the token lasts until the page reloads */
    }
  }

  function authHeaders() {
    const token = storedToken();
    return token ? { Authorization: "Bearer " + token } : {};
  }

  /* Show the token form (after a 401); a refused stored token is dropped first. */
  function askForToken(detail) {
    const panel = document.getElementById("auth-panel");
    if (!panel) return;
    if (storedToken()) {
      storeToken(null);
      const why = detail || "revoked?";
      setText("auth-reason", "The server refused the stored API token (" + why + "); enter another.");
    }
    if (panel.hidden) {
      panel.hidden = false;
      const input = document.getElementById("auth-token");
      if (input) input.focus();
    }
    updateForget();
  }

  function updateForget() {
    const forget = document.getElementById("auth-forget");
    if (forget) forget.hidden = !storedToken();
  }

  function setupAuth() {
    // Earlier versions kept the token in localStorage (shared by every tab, kept forever).
    try {
      window.localStorage.removeItem(TOKEN_KEY);
    } catch (_e) {
      /* no storage */
    }
    const form = document.getElementById("auth-form");
    if (form) {
      form.addEventListener("submit", (event) => {
        event.preventDefault();
        const token = document.getElementById("auth-token").value.trim();
        if (!token) return;
        storeToken(token);
        window.location.reload(); // every page script starts over, now with the token
      });
    }
    const forget = document.getElementById("auth-forget");
    if (forget) {
      forget.addEventListener("click", () => {
        storeToken(null);
        window.location.reload();
      });
    }
    updateForget();
  }

  /* Call the API. Returns {status, body, etag}; 304 gives body null. Raises ApiError for
   * HTTP errors (with the server's "detail") and for network failures (status 0). */
  async function api(path, options) {
    const opts = options || {};
    const headers = Object.assign({ Accept: "application/json" }, authHeaders(), opts.headers || {});
    const init = { method: opts.method || "GET", headers: headers, cache: "no-store" };
    if (opts.etag) headers["If-None-Match"] = opts.etag;
    if (opts.json !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(opts.json);
    }
    let response;
    try {
      response = await fetch(path.startsWith("/") ? path : API + "/" + path, init);
    } catch (err) {
      throw new ApiError(0, "cannot reach the ddpq server (" + err.message + ")");
    }
    const etag = response.headers.get("ETag");
    if (response.status === 304) return { status: 304, body: null, etag: opts.etag };
    let body = null;
    const type = response.headers.get("Content-Type") || "";
    if (type.includes("json")) {
      try {
        body = await response.json();
      } catch (_e) {
        body = null;
      }
    } else {
      body = await response.text();
    }
    if (!response.ok) {
      const detail = body && typeof body === "object" && "detail" in body ? body.detail : body;
      if (response.status === 401) askForToken(typeof detail === "string" ? detail : "");
      throw new ApiError(response.status, detail || response.statusText);
    }
    return { status: response.status, body: body, etag: etag };
  }

  /* Build an element: el("td", {class: "x", title: t}, "text", childNode, ...). Strings become
   * text nodes; attributes are set with setAttribute (never innerHTML). */
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "dataset") Object.assign(node.dataset, value);
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function setText(id, text) {
    const node = typeof id === "string" ? document.getElementById(id) : id;
    if (node && node.textContent !== String(text)) node.textContent = String(text);
  }

  function badge(state) {
    return el("span", { class: "badge " + state, "data-state": state }, state);
  }

  function setBadge(node, state) {
    node.className = "badge " + state;
    node.dataset.state = state;
    setText(node, state);
  }

  /* A metric value from the API: a number, null (NaN), or "Infinity"/"-Infinity". */
  function metricNumber(value) {
    if (value === "Infinity") return Infinity;
    if (value === "-Infinity") return -Infinity;
    if (value === null || value === undefined || value === "") return null;
    const n = Number(value);
    return Number.isNaN(n) ? null : n;
  }

  /* Indices of the points of a curve that no line segment shows, for a chart to mark with
   * uPlot's point markers (its series.points.filter): a point with no drawn neighbour (a
   * curve of one point, one between NaN gaps), or every point when all share one x (a
   * line between them has no length). ``xs`` and ``ys`` alike, null for a gap. Null when
   * the line shows every point (uPlot draws all markers for any array, even an empty one). */
  function lonePoints(xs, ys) {
    const lone = [];
    let x0 = null;
    let oneX = true;
    for (let i = 0; i < ys.length; i += 1) {
      if (ys[i] === null || ys[i] === undefined) continue;
      if (x0 === null) x0 = xs[i];
      else if (xs[i] !== x0) oneX = false;
      const before = i > 0 && ys[i - 1] !== null && ys[i - 1] !== undefined;
      const after = i + 1 < ys.length && ys[i + 1] !== null && ys[i + 1] !== undefined;
      if (!before && !after) lone.push(i);
    }
    if (oneX && x0 !== null) return ys.map((y, i) => (y === null || y === undefined ? -1 : i)).filter((i) => i >= 0);
    return lone.length ? lone : null;
  }

  /* latest_metrics entries are either a bare value or {step, value}. */
  function latestValue(latest, name) {
    if (!latest || !(name in latest)) return undefined;
    const v = latest[name];
    return v !== null && typeof v === "object" && "value" in v ? v.value : v;
  }

  function fmtValue(value) {
    if (value === undefined) return "–";
    if (value === null) return "NaN";
    if (value === "Infinity") return "∞";
    if (value === "-Infinity") return "−∞";
    const n = Number(value);
    if (!Number.isFinite(n)) return String(value);
    if (n === 0) return "0";
    const abs = Math.abs(n);
    if (abs >= 1e5 || abs < 1e-3) return n.toExponential(3);
    return n.toPrecision(4).replace(/\.?0+$/, "");
  }

  /* Seconds → "2 h 5 min", "3 min 4 s", "12 s". */
  function fmtDuration(seconds) {
    if (seconds === null || seconds === undefined || !Number.isFinite(Number(seconds))) return "–";
    let s = Math.max(0, Math.round(Number(seconds)));
    const d = Math.floor(s / 86400);
    s -= d * 86400;
    const h = Math.floor(s / 3600);
    s -= h * 3600;
    const m = Math.floor(s / 60);
    s -= m * 60;
    if (d) return d + " d " + h + " h";
    if (h) return h + " h " + m + " min";
    if (m) return m + " min " + s + " s";
    return s + " s";
  }

  function parseTime(iso) {
    if (!iso) return null;
    const t = Date.parse(iso);
    return Number.isNaN(t) ? null : t;
  }

  /* Age of an ISO 8601 time, e.g. "5 min ago". */
  function fmtAge(iso) {
    const t = parseTime(iso);
    if (t === null) return "–";
    return fmtDuration((Date.now() - t) / 1000) + " ago";
  }

  function fmtTime(iso) {
    const t = parseTime(iso);
    return t === null ? "–" : new Date(t).toLocaleString();
  }

  function fmtBytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let v = Number(n);
    let i = 0;
    while (v >= 1024 && i < units.length - 1) {
      v /= 1024;
      i += 1;
    }
    return (i === 0 ? String(v) : v.toFixed(1)) + " " + units[i];
  }

  /* The epoch as shown, counted from 1: the API's epoch_number, or epoch + 1 where only the
   * 0-based epoch is given (metric points); null when neither is. The CLI shows the same. */
  function epochNumber(record) {
    const r = record || {};
    if (r.epoch_number !== null && r.epoch_number !== undefined) return Number(r.epoch_number);
    if (r.epoch !== null && r.epoch !== undefined) return Number(r.epoch) + 1;
    return null;
  }

  /* Progress {step, total_steps, epoch, epoch_number, samples_per_s, eta_s} → {fraction, text, eta}. */
  function describeProgress(progress, state) {
    const p = progress || {};
    const step = Number(p.step) || 0;
    const total = Number(p.total_steps) || 0;
    let fraction = total > 0 ? Math.min(1, step / total) : 0;
    if (state === "succeeded") fraction = 1;
    const parts = [];
    if (total > 0) parts.push("step " + step + " / " + total);
    else if (step > 0) parts.push("step " + step);
    if (epochNumber(p) !== null) parts.push("epoch " + epochNumber(p));
    if (p.samples_per_s) parts.push(fmtValue(p.samples_per_s) + " samples/s");
    let eta = "";
    if (LIVE_STATES.includes(state) && p.eta_s !== null && p.eta_s !== undefined) {
      eta = "ETA " + fmtDuration(p.eta_s);
    }
    return { fraction: fraction, text: parts.join(" · "), eta: eta, step: step, total: total };
  }

  function showBanner(text, kind) {
    const node = document.getElementById("banner");
    if (!node) return;
    if (!text) {
      node.hidden = true;
      node.textContent = "";
      return;
    }
    node.className = "banner" + (kind ? " " + kind : "");
    node.textContent = text;
    node.hidden = false;
  }

  /* Run `tick` repeatedly. tick() resolves to true while something is live (poll every
   * fastMs) and false when nothing is (back off ×2 up to slowMs). Pauses while the tab is
   * hidden; a network error shows a banner and retries with backoff. */
  class Poller {
    constructor(tick, fastMs, slowMs) {
      this.tick = tick;
      this.fastMs = fastMs || 2000;
      this.slowMs = slowMs || 30000;
      this.delay = this.fastMs;
      this.timer = null;
      this.running = false;
      this.stopped = false;
      document.addEventListener("visibilitychange", () => {
        if (document.visibilityState === "visible") this.now();
      });
    }

    start() {
      this.now();
      return this;
    }

    stop() {
      this.stopped = true;
      if (this.timer) clearTimeout(this.timer);
      this.timer = null;
    }

    /* Poll at once (e.g. after a user action), then resume the schedule. */
    now() {
      if (this.stopped) return;
      if (this.timer) clearTimeout(this.timer);
      this.timer = null;
      this.fast = true;
      this.run();
    }

    async run() {
      if (this.running) {
        this.again = true;
        return;
      }
      this.running = true;
      let live = false;
      try {
        live = await this.tick();
        showBanner(null);
        this.delay = live ? this.fastMs : Math.min(this.slowMs, this.fast ? this.fastMs : this.delay * 2);
      } catch (err) {
        if (err.status === 401) showBanner(null); // the token form says it
        else showBanner(err.status === 0 ? err.message + "; retrying…" : "Error: " + err.message, "error");
        this.delay = Math.min(this.slowMs, this.delay * 2);
      } finally {
        this.running = false;
        this.fast = false;
      }
      if (this.stopped) return;
      if (this.again) {
        this.again = false;
        this.run();
        return;
      }
      if (document.visibilityState === "hidden") return; // visibilitychange resumes
      this.timer = setTimeout(() => this.run(), this.delay);
    }
  }

  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", setupAuth);
  else setupAuth();

  window.ddpq = {
    API: API,
    LIVE_STATES: LIVE_STATES,
    TERMINAL_STATES: TERMINAL_STATES,
    ApiError: ApiError,
    api: api,
    el: el,
    setText: setText,
    badge: badge,
    setBadge: setBadge,
    metricNumber: metricNumber,
    lonePoints: lonePoints,
    latestValue: latestValue,
    fmtValue: fmtValue,
    fmtDuration: fmtDuration,
    fmtAge: fmtAge,
    fmtTime: fmtTime,
    fmtBytes: fmtBytes,
    parseTime: parseTime,
    describeProgress: describeProgress,
    epochNumber: epochNumber,
    showBanner: showBanner,
    clear: clear,
    Poller: Poller,
  };
})();
