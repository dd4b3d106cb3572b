// The dashboard's one script: shows times in the reader's zone and refreshes the pool table
// from /dashboard/api/pools every 2 seconds. The page works without it.
"use strict";
(function () {
  function showTimes(root) {
    root.querySelectorAll("time[data-ms]").forEach(function (t) {
      var d = new Date(Number(t.dataset.ms));
      t.dateTime = d.toISOString();
      t.textContent = d.toLocaleTimeString();
    });
  }
  function text(n) { return n === null || n === undefined ? "\u2014" : String(n); }
  function setTime(cell, ms, extra) {
    cell.textContent = "";
    if (ms === null || ms === undefined) { cell.textContent = "\u2014"; return; }
    var t = document.createElement("time");
    t.dataset.ms = String(ms);
    cell.appendChild(t);
    if (extra) {
      var s = document.createElement("span");
      s.className = "cause";
      s.textContent = " " + extra;
      cell.appendChild(s);
    }
  }
  function update(pools) {
    pools.forEach(function (p) {
      var row = document.querySelector('tr[data-pool="' + p.name + '"]');
      if (!row) { return; }
      var cell = function (f) { return row.querySelector('[data-field="' + f + '"]'); };
      cell("inFlight").textContent = String(p.inFlight);
      cell("effectiveLimit").textContent = String(p.effectiveLimit);
      cell("queued").textContent = text(p.queued);
      cell("learnedLimit").textContent = text(p.learnedLimit);
      cell("learnedRpm").textContent = text(p.learnedRpm);
      setTime(cell("lastThrottle"), p.lastThrottleAt, p.lastThrottleCause);
      setTime(cell("pausedUntil"), p.pausedUntil !== null ? p.pausedUntil : p.pacedUntil);
    });
    showTimes(document);
  }
  function poll() {
    fetch("/dashboard/api/pools", { credentials: "same-origin", cache: "no-store" })
      .then(function (r) {
        if (r.status === 401) { window.location.assign("/dashboard/login"); return null; }
        return r.ok ? r.json() : null;
      })
      .then(function (body) { if (body) { update(body.items); } })
      .catch(function () { /* the next poll tries again */ });
  }
  // Redraws the pool page's chart with the rules the server drew it by (chart.rs).
  function draw(seconds) {
    var svg = document.getElementById("history-chart");
    if (!svg) { return; }
    var fields = ["admitted", "refused", "queued", "origin429"];
    var max = 1;
    seconds.forEach(function (s) { fields.forEach(function (f) { max = Math.max(max, s[f]); }); });
    var height = 120;
    fields.forEach(function (f) {
      var total = 0;
      var points = seconds.map(function (s, x) {
        total += s[f];
        return x + "," + (height - Math.floor(s[f] * height / max));
      });
      var line = svg.querySelector('[data-series="' + f + '"]');
      if (line) { line.setAttribute("points", points.join(" ")); }
      var shown = document.querySelector('[data-total="' + f + '"]');
      if (shown) { shown.textContent = String(total); }
    });
  }
  function pollHistory(pool) {
    fetch("/dashboard/api/pools/" + encodeURIComponent(pool) + "/history",
          { credentials: "same-origin", cache: "no-store" })
      .then(function (r) {
        if (r.status === 401) { window.location.assign("/dashboard/login"); return null; }
        return r.ok ? r.json() : null;
      })
      .then(function (body) { if (body) { draw(body.seconds); } })
      .catch(function () { /* the next poll tries again */ });
  }
  document.addEventListener("DOMContentLoaded", function () {
    showTimes(document);
    if (document.querySelector("tr[data-pool]")) { setInterval(poll, 2000); }
    var history = document.querySelector("section[data-history]");
    if (history) {
      setInterval(function () { pollHistory(history.dataset.history); }, 2000);
    }
  });
})();
