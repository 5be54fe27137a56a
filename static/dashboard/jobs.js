/* Jobs list: progress moves with each committed step; anything else (a new job, a status or checkpoint
   change) re-reads the table body from the server, as does every (re)connect. */
(function () {
  "use strict";
  const table = document.querySelector("[data-jobs-table]");
  if (!table) return;
  const K = window.Kiln;
  const body = table.querySelector("[data-rows]");

  let live = null;
  async function refresh() {
    try {
      body.innerHTML = await K.fetchHTML(table.dataset.rowsUrl);
    } catch (error) {
      if (error.signedOut && live) live.stop("signed out: reload the page to sign in");
    }
  }
  const refreshSoon = K.debounce(refresh, 250);

  function row(jobId) {
    return body.querySelector('tr[data-job="' + jobId + '"]');
  }

  live = K.connect("/ws/jobs/", {
    onopen: refresh,
    "job.step": function (message) {
      const tr = row(message.job_id);
      const step = message.metrics && message.metrics.step;
      if (!tr) { refreshSoon(); return; }
      if (typeof step !== "number") return;
      const total = Number(tr.dataset.total) || 0;
      tr.querySelector('[data-field="progress"]').textContent = step + (total ? " / " + total : "");
      if (total) tr.querySelector('[data-field="bar"]').style.width = Math.min(100, Math.round(100 * step / total)) + "%";
    },
    "job.status": refreshSoon,
    "job.checkpoint": refreshSoon,
  });
})();
