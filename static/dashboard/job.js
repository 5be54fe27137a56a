/* Job detail: charts from the database history, then live deltas; panels re-read from the server on
   (re)connect and whenever a checkpoint or status event says they changed. */
(function () {
  "use strict";
  const root = document.querySelector("[data-job-page]");
  if (!root) return;
  const K = window.Kiln;
  const TERMINAL = ["succeeded", "cancelled", "failed", "lost"];
  const ETA_WINDOW = 20;  // recent steps the time-per-step estimate uses

  const specs = JSON.parse(document.getElementById("kiln-charts").textContent);
  const earlier = JSON.parse(document.getElementById("kiln-earlier").textContent);
  const steps = new Map();  // step -> metrics of this run
  JSON.parse(document.getElementById("kiln-metrics").textContent).forEach(function (m) { steps.set(m.step, m); });
  const state = {
    status: root.dataset.status,
    committed: Number(root.dataset.committed) || 0,
    total: root.dataset.total ? Number(root.dataset.total) : null,
  };

  function ordered() {
    return Array.from(steps.values()).sort(function (a, b) { return a.step - b.step; });
  }
  // The last step of the unbroken run of steps from the first one held: a resync asks for
  // everything after it, so live events that arrived past a gap cannot hide the gap.
  function contiguousEnd() {
    if (steps.size === 0) return 0;
    let step = Math.min.apply(null, Array.from(steps.keys()));
    while (steps.has(step + 1)) step += 1;
    return step;
  }

  // -- progress and ETA --

  function eta(points) {
    if (TERMINAL.indexOf(state.status) >= 0) return "";
    if (state.status === "queued") return "waiting for a worker";
    if (!state.total || !points.length) return "";
    const recent = points.slice(-ETA_WINDOW).filter(function (p) { return typeof p.elapsed_seconds === "number"; });
    if (!recent.length) return "";
    const last = recent[recent.length - 1];
    let perStep;
    if (recent.length > 1 && last.step > recent[0].step) {
      perStep = (last.elapsed_seconds - recent[0].elapsed_seconds) / (last.step - recent[0].step);
    } else {
      const first = points[0].step - 1;  // a resumed run's clock starts at its first step
      perStep = last.elapsed_seconds / Math.max(1, last.step - first);
    }
    const remaining = Math.max(0, state.total - state.committed);
    if (!remaining) return "finishing";
    return "about " + K.formatDuration(perStep * remaining) + " left";
  }

  function renderProgress() {
    const badge = root.querySelector("[data-status-badge]");
    badge.className = "status status-" + state.status;
    badge.textContent = state.status.charAt(0).toUpperCase() + state.status.slice(1);
    const percent = state.total ? Math.max(0, Math.min(100, Math.round(100 * state.committed / state.total)))
      : (state.status === "succeeded" ? 100 : 0);
    root.querySelector("[data-progress-text]").textContent =
      "Step " + state.committed + (state.total ? " of " + state.total : "");
    root.querySelector("[data-percent]").textContent = percent + "%";
    const bar = root.querySelector("[data-progress-bar]");
    bar.setAttribute("aria-valuenow", percent);
    bar.firstElementChild.style.width = percent + "%";
    root.querySelector("[data-eta]").textContent = eta(ordered());
    root.dataset.status = state.status;
    root.dataset.committed = state.committed;
  }

  // -- charts --

  function renderCharts() {
    const points = ordered();
    specs.forEach(function (spec) {
      const figure = root.querySelector('[data-chart="' + spec.key + '"]');
      if (!figure) return;
      const pick = function (m) { return [m.step, m[spec.key] === undefined ? null : m[spec.key]]; };
      const run = points.map(pick), before = earlier.map(pick);
      const has = function (p) { return p[1] !== null; };
      const series = [];
      if (before.some(has)) series.push({ name: "earlier", points: before });
      series.push({ name: "run", points: run });
      // GRPO/OPD diagnostics that a run does not record stay hidden instead of drawing an empty chart
      figure.hidden = spec.key !== specs[0].key && !run.some(has) && !before.some(has);
      window.KilnCharts.draw(figure.querySelector("[data-plot]"), series);
      const latest = run.filter(has).pop() || before.filter(has).pop();
      figure.querySelector("[data-latest]").textContent = latest ? K.formatNumber(latest[1]) + " at step " + latest[0] : "";
    });
  }

  let frame = null;
  function renderSoon() {
    if (frame) return;
    frame = requestAnimationFrame(function () { frame = null; renderProgress(); renderCharts(); });
  }

  // -- events and panels --

  function addEvent(event) {
    const list = root.querySelector("[data-events]");
    if (!list) return;
    const empty = list.querySelector("[data-no-events]");
    if (empty) empty.remove();
    const item = document.createElement("li");
    item.className = "event fresh level-" + event.level;
    const time = document.createElement("time");
    const when = new Date(event.time);
    time.dateTime = event.time;
    time.textContent = isNaN(when) ? "" : when.toISOString().slice(11, 19);
    const level = document.createElement("span");
    level.className = "level";
    level.textContent = event.level;
    const message = document.createElement("span");
    message.className = "message";
    message.textContent = event.message;
    item.append(time, level, message);
    list.prepend(item);
  }

  function applyPanels(panels) {
    Object.keys(panels).forEach(function (name) {
      const target = root.querySelector('[data-panel="' + name + '"]');
      if (target && target.innerHTML !== panels[name]) target.innerHTML = panels[name];
    });
  }

  let syncing = null, again = false, retryMs = 1000, retry = null;
  async function resync() {
    if (syncing) { again = true; return; }
    syncing = true;
    clearTimeout(retry);
    try {
      const data = await K.fetchJSON(root.dataset.snapshotUrl + "?after_step=" + contiguousEnd());
      retryMs = 1000;
      data.metrics.forEach(function (m) { steps.set(m.step, m); });
      state.status = data.job.status;
      // a job's committed step only grows: steps pushed while this snapshot was on its way stay
      state.committed = Math.max(state.committed, data.job.committed_step);
      state.total = data.job.total_steps;
      applyPanels(data.panels);
      renderSoon();
    } catch (error) {
      if (error.signedOut) { live.stop("signed out: reload the page to sign in"); return; }
      // a failed snapshot (a busy or restarting server) is asked for again, or the steps it would
      // have filled in stay missing from the charts
      retry = setTimeout(resync, retryMs);
      retryMs = Math.min(retryMs * 2, 15000);
    } finally {
      syncing = null;
      if (again) { again = false; resync(); }
    }
  }
  const resyncSoon = K.debounce(resync, 200);

  renderProgress();
  renderCharts();
  window.addEventListener("resize", K.debounce(renderCharts, 150));

  const live = K.connect(root.dataset.wsPath, {
    onopen: resync,
    "job.step": function (message) {
      const metrics = message.metrics || {};
      if (typeof metrics.step !== "number") return;
      steps.set(metrics.step, metrics);
      state.committed = Math.max(state.committed, metrics.step);
      renderSoon();
    },
    "job.status": function (message) {
      state.status = message.status;
      if (message.progress) {
        state.committed = Math.max(state.committed, message.progress.committed_step);
        state.total = message.progress.total_steps;
      }
      renderSoon();
      resyncSoon();
    },
    "job.checkpoint": function () { resyncSoon(); },
    "job.event": addEvent,
  });
})();
