/* Job detail: charts from the database history, then live deltas; every panel re-read from the server
   (job_snapshot) on (re)connect and whenever a status, checkpoint or job event says something changed
   (promotion and evaluation news arrive as job events), a burst of events costing one request. */
(function () {
  "use strict";

  // -- pure helpers (window.KilnJob, so the browser tests can check them) --

  const ETA_SPAN = 20;  // steps: the moving average weighs a step's time by (1 - 2/(ETA_SPAN+1))^age
  const ETA_SEED = 5;   // the first steps' median seeds it, so one slow warm-up step cannot

  function isNumber(v) { return typeof v === "number" && isFinite(v); }

  /* Seconds each step took, from elapsed_seconds (a run's clock, which restarts when a resumed run
     starts): [[step, seconds], ...]. A step after a gap shares the gap's time evenly. */
  function stepDurations(points) {
    const out = [];
    let prev = null;
    points.forEach(function (p) {
      if (!isNumber(p.elapsed_seconds)) { prev = null; return; }
      if (prev && p.step > prev.step && p.elapsed_seconds >= prev.elapsed_seconds) {
        out.push([p.step, (p.elapsed_seconds - prev.elapsed_seconds) / (p.step - prev.step)]);
      } else if (!prev || p.elapsed_seconds < prev.elapsed_seconds) {
        out.push([p.step, p.elapsed_seconds]);  // the first step of a run's clock
      }
      prev = p;
    });
    return out;
  }

  /* An exponentially weighted moving average of recent step times (seconds per step), or null. */
  function stepSeconds(points) {
    const durations = stepDurations(points).map(function (d) { return d[1]; });
    if (!durations.length) return null;
    const seed = durations.slice(0, ETA_SEED).slice().sort(function (a, b) { return a - b; });
    let average = seed[Math.floor((seed.length - 1) / 2)];
    const alpha = 2 / (ETA_SPAN + 1);
    durations.slice(seed.length).forEach(function (d) { average += alpha * (d - average); });
    return average;
  }

  /* Tokens per second of each step, from its `tokens` and the time it took; null where either is unknown. */
  function tokensPerSecond(points) {
    const seconds = new Map(stepDurations(points));
    return points.map(function (p) {
      const s = seconds.get(p.step);
      return [p.step, isNumber(p.tokens) && isNumber(s) && s > 0 ? p.tokens / s : null];
    });
  }

  const DERIVED = { tokens_per_second: tokensPerSecond };
  function series(points, key) {
    if (DERIVED[key]) return DERIVED[key](points);
    return points.map(function (m) { return [m.step, isNumber(m[key]) ? m[key] : null]; });
  }

  window.KilnJob = { stepDurations: stepDurations, stepSeconds: stepSeconds, tokensPerSecond: tokensPerSecond,
                     series: series };

  const root = document.querySelector("[data-job-page]");
  if (!root) return;
  const K = window.Kiln;
  const TERMINAL = ["succeeded", "cancelled", "failed", "lost"];
  const COALESCE_MS = 250;  // events within this window of the first one share one snapshot request

  const specs = JSON.parse(document.getElementById("kiln-charts").textContent);
  const earlier = JSON.parse(document.getElementById("kiln-earlier").textContent);
  const steps = new Map();  // step -> metrics of this run
  JSON.parse(document.getElementById("kiln-metrics").textContent).forEach(function (m) { steps.set(m.step, m); });
  const state = {
    status: root.dataset.status,
    committed: Number(root.dataset.committed) || 0,
    total: root.dataset.total ? Number(root.dataset.total) : null,
    snapshots: 0,  // snapshots applied since the page loaded (data-snapshots, once drawn)
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
    const perStep = stepSeconds(points);
    if (perStep === null) return "";
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
    root.dataset.snapshots = state.snapshots;
  }

  // -- charts --

  function renderCharts() {
    const points = ordered();
    specs.forEach(function (spec) {
      const figure = root.querySelector('[data-chart="' + spec.key + '"]');
      if (!figure) return;
      const run = series(points, spec.key), before = series(earlier, spec.key);
      const has = function (p) { return p[1] !== null; };
      const lines = [];
      if (before.some(has)) lines.push({ name: "earlier", points: before });
      lines.push({ name: "run", points: run });
      // metrics that a run does not report stay hidden instead of drawing an empty chart
      figure.hidden = spec.key !== specs[0].key && !run.some(has) && !before.some(has);
      if (figure.hidden) return;
      window.KilnCharts.draw(figure.querySelector("[data-plot]"), lines, { floor: spec.floor });
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

  // A redrawn panel keeps a disclosure the person opened (the stop confirmation) open.
  function applyPanels(panels) {
    Object.keys(panels).forEach(function (name) {
      const target = root.querySelector('[data-panel="' + name + '"]');
      if (!target || target.innerHTML === panels[name]) return;
      const open = Array.from(target.querySelectorAll("details[data-disclosure][open]"))
        .map(function (d) { return d.dataset.disclosure; });
      target.innerHTML = panels[name];
      open.forEach(function (key) {
        const details = target.querySelector('details[data-disclosure="' + key + '"]');
        if (details) details.open = true;
      });
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
      state.snapshots += 1;
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
  // One snapshot for a burst: the first event schedules it, later ones in the window ride along (a steady
  // stream of events still gets a snapshot every COALESCE_MS, unlike a debounce that would wait it out).
  let scheduled = null;
  function resyncSoon() {
    if (scheduled) return;
    scheduled = setTimeout(function () { scheduled = null; resync(); }, COALESCE_MS);
  }

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
    "job.event": function (message) { addEvent(message); resyncSoon(); },
  });
})();
