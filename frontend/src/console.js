/*
 * Live charts of the Harli operator console.
 *
 * Every element with `data-chart-url` is a chart. Its URL answers JSON:
 *   {"figure": {"data": [...], "layout": {...}}, "empty": bool, "message": str,
 *    "points": {"trace name": count}}
 * or, on failure, {"error": {"message": ...}} with a 4xx/5xx status.
 * Charts are drawn with Plotly.react (no page reload) on load, every `data-refresh-ms` of <body>
 * (default 5000; 3x for 6h and 6x for 24h) while the tab is visible, and when the time range
 * changes.
 *
 * Each chart element carries its state for people and tests alike:
 *   data-state   loading | ready | empty | error
 *   data-loads   how many refreshes have completed (successfully or not)
 * The time range (15m, 1h, 6h, 24h) comes from `?range=` and the `.range-selector` buttons.
 * Forms with `data-confirm` ask the question before they submit.
 *
 * Live parts: `<main data-live-url>` answers {"parts": {name: {"html", "version"}}}; each
 * `[data-part=name]` element is replaced when its `data-version` differs (see console/live.py).
 * `<main>` carries `data-live-state` (ready | error) and `data-live-loads` like a chart.
 */
(function () {
  "use strict";

  const PLOT_CONFIG = { responsive: true, displaylogo: false, modeBarButtonsToRemove: ["lasso2d", "select2d"] };
  const body = document.body;
  const refreshMs = Math.max(1000, Number(body.dataset.refreshMs || 5000));
  const charts = Array.from(document.querySelectorAll("[data-chart-url]"));
  const rangeButtons = Array.from(document.querySelectorAll(".range-selector [data-range]"));
  const validRanges = rangeButtons.map((button) => button.dataset.range);
  let range = initialRange();

  function initialRange() {
    const asked = new URLSearchParams(window.location.search).get("range");
    if (asked && validRanges.includes(asked)) return asked;
    return body.dataset.defaultRange || "1h";
  }

  function chartUrl(el) {
    const url = new URL(el.dataset.chartUrl, window.location.href);
    if (el.dataset.ranged !== "false") url.searchParams.set("range", range);
    return url.toString();
  }

  function card(el) {
    return el.closest(".chart-card") || el.parentElement;
  }

  function showMessage(el, kind, text) {
    const box = card(el).querySelector(".chart-message");
    if (!box) return;
    box.textContent = text || "";
    box.className = "chart-message" + (kind ? " chart-message--" + kind : "");
    box.hidden = !text;
  }

  function markUpdated(el) {
    const stamp = card(el).querySelector(".chart-updated");
    if (stamp) stamp.textContent = "updated " + new Date().toLocaleTimeString();
  }

  async function readJson(response) {
    try {
      return await response.json();
    } catch (_err) {
      return null;
    }
  }

  async function refresh(el) {
    if (el.dataset.busy === "1") return;
    el.dataset.busy = "1";
    if (!el.dataset.state) el.dataset.state = "loading";
    try {
      const response = await fetch(chartUrl(el), {
        headers: { Accept: "application/json" },
        credentials: "same-origin",
        cache: "no-store",
      });
      const payload = await readJson(response);
      if (!response.ok || payload === null) {
        const reason = payload && payload.error ? payload.error.message : "HTTP " + response.status;
        throw new Error(reason);
      }
      if (payload.empty) {
        window.Plotly.purge(el);
        el.classList.add("chart--empty");
        el.dataset.state = "empty";
        showMessage(el, "empty", payload.message || "No data in this time range yet.");
      } else {
        el.classList.remove("chart--empty");
        await window.Plotly.react(el, payload.figure.data, payload.figure.layout, PLOT_CONFIG);
        el.dataset.state = "ready";
        showMessage(el, "", "");
      }
      markUpdated(el);
    } catch (err) {
      el.dataset.state = "error";
      showMessage(el, "error", "Could not refresh this chart: " + err.message + ". Retrying.");
    } finally {
      el.dataset.busy = "0";
      el.dataset.loads = String(Number(el.dataset.loads || 0) + 1);
    }
  }

  const main = document.querySelector("main[data-live-url]");
  const liveNote = document.createElement("p");
  liveNote.className = "chart-message chart-message--error live-note";
  liveNote.hidden = true;
  if (main) main.prepend(liveNote);

  async function refreshParts() {
    if (!main || main.dataset.busy === "1") return;
    main.dataset.busy = "1";
    try {
      const url = new URL(main.dataset.liveUrl, window.location.href);
      url.searchParams.set("range", range);
      const response = await fetch(url.toString(), {
        headers: { Accept: "application/json" },
        credentials: "same-origin",
        cache: "no-store",
      });
      const payload = await readJson(response);
      if (!response.ok || payload === null || !payload.parts) {
        const reason = payload && payload.error ? payload.error.message : "HTTP " + response.status;
        throw new Error(reason);
      }
      for (const [name, part] of Object.entries(payload.parts)) {
        const el = main.querySelector('[data-part="' + name + '"]');
        if (el && el.dataset.version !== part.version) {
          el.innerHTML = part.html;
          el.dataset.version = part.version;
        }
      }
      main.dataset.liveState = "ready";
      liveNote.hidden = true;
    } catch (err) {
      main.dataset.liveState = "error";
      liveNote.textContent = "Could not refresh this page's figures: " + err.message + ". Retrying.";
      liveNote.hidden = false;
    } finally {
      main.dataset.busy = "0";
      main.dataset.liveLoads = String(Number(main.dataset.liveLoads || 0) + 1);
    }
  }

  function refreshAll() {
    return Promise.all([refreshParts(), ...charts.map(refresh)]);
  }

  function selectRange(next) {
    if (!validRanges.includes(next)) return;
    range = next;
    for (const button of rangeButtons) {
      button.setAttribute("aria-pressed", String(button.dataset.range === range));
    }
    const url = new URL(window.location.href);
    url.searchParams.set("range", range);
    window.history.replaceState(null, "", url.toString());
    refreshAll();
  }

  for (const button of rangeButtons) {
    button.setAttribute("aria-pressed", String(button.dataset.range === range));
    button.addEventListener("click", () => selectRange(button.dataset.range));
  }

  // Destructive forms ask first: <form data-confirm="question">.
  for (const form of document.querySelectorAll("form[data-confirm]")) {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) event.preventDefault();
    });
  }

  // Longer windows change slowly and cost more to read: refresh them less often.
  const RANGE_SLOWDOWN = { "6h": 3, "24h": 6 };

  function startTimer() {
    const tick = () => {
      if (!document.hidden) refreshAll();
      window.setTimeout(tick, refreshMs * (RANGE_SLOWDOWN[range] || 1));
    };
    window.setTimeout(tick, refreshMs * (RANGE_SLOWDOWN[range] || 1));
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) refreshAll();
    });
  }

  if (charts.length > 0 && typeof window.Plotly === "undefined") {
    for (const el of charts) {
      el.dataset.state = "error";
      showMessage(el, "error", "The charting library did not load; run the set-up (npm run build).");
    }
    charts.length = 0;
  }
  if (charts.length > 0) refreshAll();
  // Parts arrive rendered with the page: the first refresh waits for the first tick.
  if (charts.length > 0 || main) startTimer();

  window.harliConsole = { refreshAll, selectRange, get range() { return range; } };
})();
