/* Kiln charts: small hand-written SVG line charts, drawn at the container's width. */
(function () {
  "use strict";

  const SVG = "http://www.w3.org/2000/svg";
  const HEIGHT = 180;
  const PAD = { left: 52, right: 14, top: 10, bottom: 24 };

  function el(name, attributes, parent) {
    const node = document.createElementNS(SVG, name);
    for (const key in attributes) node.setAttribute(key, attributes[key]);
    if (parent) parent.appendChild(node);
    return node;
  }

  function extent(values) {
    let low = Infinity, high = -Infinity;
    values.forEach(function (v) { if (v < low) low = v; if (v > high) high = v; });
    return [low, high];
  }

  /* a path through [x, y] points; a null y breaks the line */
  function pathOf(points, sx, sy) {
    let d = "", pen = false;
    points.forEach(function (p) {
      if (p[1] === null || p[1] === undefined || !isFinite(p[1])) { pen = false; return; }
      d += (pen ? "L" : "M") + sx(p[0]).toFixed(1) + " " + sy(p[1]).toFixed(1);
      pen = true;
    });
    return d;
  }

  /* The y-range drawn for values from LOW to HIGH: a little margin either side, but never below FLOOR
     (a loss, a rate or a norm cannot be negative) while every value is at or above it. */
  function yRange(low, high, floor) {
    let y0 = low, y1 = high;
    if (y0 === y1) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
    const margin = (y1 - y0) * 0.06;
    y0 -= margin; y1 += margin;
    if (typeof floor === "number" && low >= floor && y0 < floor) y0 = floor;
    return [y0, y1];
  }

  /* draw(container, [{name: "earlier"|"run", points: [[step, value], ...]}], {floor: 0 | null}) */
  function draw(container, series, options) {
    const floor = options && typeof options.floor === "number" ? options.floor : null;
    const all = [];
    series.forEach(function (s) { s.points.forEach(function (p) { if (p[1] !== null && isFinite(p[1])) all.push(p); }); });
    container.textContent = "";
    if (!all.length) {
      const p = document.createElement("p");
      p.className = "muted small";
      p.textContent = "Waiting for the first committed step.";
      container.appendChild(p);
      return null;
    }
    const width = Math.max(240, Math.floor(container.clientWidth || 600));
    let [x0, x1] = extent(all.map(function (p) { return p[0]; }));
    const [low, high] = extent(all.map(function (p) { return p[1]; }));
    const [y0, y1] = yRange(low, high, floor);
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    const plotW = width - PAD.left - PAD.right, plotH = HEIGHT - PAD.top - PAD.bottom;
    const sx = function (x) { return PAD.left + (x - x0) / (x1 - x0) * plotW; };
    const sy = function (y) { return PAD.top + (1 - (y - y0) / (y1 - y0)) * plotH; };

    const svg = el("svg", { viewBox: "0 0 " + width + " " + HEIGHT, width: width, height: HEIGHT, role: "img",
                            "data-y-min": y0, "data-y-max": y1 });
    for (let i = 0; i <= 3; i++) {
      const y = y0 + (y1 - y0) * i / 3;
      el("line", { class: "grid-line", x1: PAD.left, x2: width - PAD.right, y1: sy(y), y2: sy(y) }, svg);
      el("text", { class: "axis-text", x: PAD.left - 6, y: sy(y) + 4, "text-anchor": "end" }, svg).textContent = window.Kiln.formatNumber(y);
    }
    const ticks = [Math.ceil(x0), Math.round((x0 + x1) / 2), Math.floor(x1)].filter(function (v, i, a) { return a.indexOf(v) === i && v >= x0 && v <= x1; });
    ticks.forEach(function (x, i) {
      const anchor = i === 0 ? "start" : (i === ticks.length - 1 ? "end" : "middle");
      el("text", { class: "axis-text", x: sx(x), y: HEIGHT - 6, "text-anchor": anchor }, svg).textContent = "step " + x;
    });
    series.forEach(function (s) {
      const d = pathOf(s.points, sx, sy);
      if (d) el("path", { class: "series-" + s.name, d: d, "data-series": s.name, "data-points": s.points.length }, svg);
    });
    const last = series[series.length - 1].points.filter(function (p) { return p[1] !== null && isFinite(p[1]); }).pop();
    if (last) el("circle", { class: "last-dot", cx: sx(last[0]), cy: sy(last[1]), r: 3 }, svg);
    svg.setAttribute("aria-label", "line chart from step " + Math.ceil(x0) + " to " + Math.floor(x1));
    container.appendChild(svg);
    return svg;
  }

  window.KilnCharts = { draw: draw, yRange: yRange };
})();
