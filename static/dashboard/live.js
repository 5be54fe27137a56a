/* Kiln live updates: one WebSocket per page, reconnected with exponential backoff; after every
   (re)connect the page resynchronises from the server, then applies the pushed events. No polling. */
(function () {
  "use strict";

  const MIN_DELAY = 500;      // ms before the first reconnect
  const MAX_DELAY = 30000;    // ms ceiling of the backoff
  const CLOSED_FOR_GOOD = { 4401: "signed out: reload the page to sign in", 4404: "this job is not available" };

  function indicator(state, text) {
    document.querySelectorAll("[data-live-indicator]").forEach(function (el) {
      el.hidden = false;  // hidden until this script runs: without it the page is not live (its <noscript> says so)
      el.dataset.state = state;
      el.textContent = text;
    });
  }

  /* connect("/ws/jobs/", {onopen: fn, "job.step": fn, ...}) */
  function connect(path, handlers) {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    let attempt = 0;
    let socket = null;
    let stopped = false;

    function open() {
      let opened = false;
      indicator(attempt ? "reconnecting" : "connecting", attempt ? "reconnecting" : "connecting");
      socket = new WebSocket(scheme + "//" + location.host + path);
      socket.addEventListener("open", function () {
        opened = true;
        attempt = 0;
        indicator("live", "live");
        if (handlers.onopen) handlers.onopen();
      });
      socket.addEventListener("message", function (event) {
        let message;
        try { message = JSON.parse(event.data); } catch (error) { return; }
        const handler = handlers[message.type];
        if (handler) handler(message);
      });
      socket.addEventListener("close", function (event) {
        if (stopped) return;
        if (CLOSED_FOR_GOOD[event.code]) {
          indicator("offline", CLOSED_FOR_GOOD[event.code]);
          return;
        }
        const delay = Math.min(MAX_DELAY, MIN_DELAY * Math.pow(2, attempt)) * (0.75 + Math.random() / 2);
        attempt += 1;
        indicator("reconnecting", "reconnecting in " + Math.max(1, Math.round(delay / 1000)) + " s");
        const retry = setTimeout(open, delay);
        if (!opened) {
          // a refused handshake looks like a network error to the page: ask whether the session ended
          fetch(location.pathname, { credentials: "same-origin", redirect: "manual" }).then(function (response) {
            if (response.type === "opaqueredirect") {
              clearTimeout(retry);
              stop("signed out: reload the page to sign in");
            }
          }).catch(function () {});
        }
      });
    }

    function stop(reason) {
      stopped = true;
      if (socket) socket.close();
      indicator("offline", reason || "offline");
    }

    window.addEventListener("pagehide", function () { stopped = true; if (socket) socket.close(); });
    open();
    return { stop: stop };
  }

  /* GET a URL of this site; a redirect (to the sign-in page) or an error stops the live view. */
  async function fetchPage(url, accept) {
    const response = await fetch(url, { credentials: "same-origin", headers: { Accept: accept } });
    if (response.redirected || !response.ok) {
      const error = new Error(response.redirected ? "signed out" : "HTTP " + response.status);
      error.signedOut = response.redirected;
      throw error;
    }
    return response;
  }
  async function fetchJSON(url) { return (await fetchPage(url, "application/json")).json(); }
  async function fetchHTML(url) { return (await fetchPage(url, "text/html")).text(); }

  function debounce(fn, ms) {
    let timer = null;
    return function () {
      clearTimeout(timer);
      timer = setTimeout(fn, ms);
    };
  }

  /* 0.000123 -> "0.000123", 2.3456 -> "2.35", 12345.6 -> "12346" */
  function formatNumber(value) {
    if (value === null || value === undefined || !isFinite(value)) return "–";
    const abs = Math.abs(value);
    if (abs >= 1000) return value.toFixed(0);
    return String(Number(value.toPrecision(3)));
  }

  function formatDuration(seconds) {
    if (!isFinite(seconds) || seconds < 0) return "";
    seconds = Math.round(seconds);
    if (seconds < 60) return seconds + " s";
    const minutes = Math.floor(seconds / 60);
    if (minutes < 60) return minutes + " min " + (seconds % 60) + " s";
    return Math.floor(minutes / 60) + " h " + (minutes % 60) + " min";
  }

  function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.appendChild(area);
    area.select();
    try { document.execCommand("copy"); } finally { area.remove(); }
    return Promise.resolve();
  }

  /* any [data-copy] button copies its value, now or after a panel is replaced */
  document.addEventListener("click", function (event) {
    const button = event.target.closest("[data-copy]");
    if (!button) return;
    copyText(button.dataset.copy).then(function () {
      const label = button.textContent;
      button.textContent = "Copied";
      setTimeout(function () { button.textContent = label; }, 1500);
    });
  });

  /* filter forms submit on change */
  document.querySelectorAll("form[data-autosubmit] select").forEach(function (select) {
    select.addEventListener("change", function () { select.form.submit(); });
  });

  window.Kiln = {
    connect: connect, fetchJSON: fetchJSON, fetchHTML: fetchHTML, debounce: debounce,
    formatNumber: formatNumber, formatDuration: formatDuration, indicator: indicator,
  };
})();
