// The browser tests' and the screenshot script's shared parts: the real `nthbouncer` binary
// (`serve` from a temp config on loopback ports, in front of `nthbouncer sandbox` as the origin),
// Debian's Chromium driven by playwright-core, axe-core injected into each page, and load
// driven from Node through the proxy.
//
// Nothing here writes into the source tree: the server's config and data live in a temp dir
// that `stop()` removes.

import { spawn } from "node:child_process";
import { mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import http from "node:http";
import net from "node:net";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { createRequire } from "node:module";

import { chromium } from "playwright-core";

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(import.meta.url);
export const repoRoot = path.resolve(here, "../..");

export const ADMIN_TOKEN = "browser-test-admin-token-0123456789";
export const POOL_KEY = "browser-test-pool-key-0123456789abcdef";
export const API_HOST = "api.localhost";

/// The binary the tests run: $NTHBOUNCER_BIN, else cargo's debug build ($CARGO_TARGET_DIR or
/// target/). `tests/browser/run` builds it first.
export function binaryPath() {
  if (process.env.NTHBOUNCER_BIN) return process.env.NTHBOUNCER_BIN;
  const targetDir = process.env.CARGO_TARGET_DIR || path.join(repoRoot, "target");
  return path.join(path.resolve(repoRoot, targetDir), "debug", "nthbouncer");
}

/// A loopback port that was free a moment ago.
export function freePort() {
  return new Promise((resolve, reject) => {
    const srv = net.createServer();
    srv.once("error", reject);
    srv.listen(0, "127.0.0.1", () => {
      const { port } = srv.address();
      srv.close(() => resolve(port));
    });
  });
}

function isFree(port) {
  return new Promise((resolve) => {
    const srv = net.createServer();
    srv.once("error", () => resolve(false));
    srv.listen(port, "127.0.0.1", () => srv.close(() => resolve(true)));
  });
}

/// Polls `probe` until it returns something truthy and returns that; fails after `tries`
/// attempts with `what` and the last value seen. The bound is a count of polls, not a time the
/// test asserts on.
export async function waitUntil(what, probe, { tries = 400, everyMs = 50 } = {}) {
  let last;
  for (let i = 0; i < tries; i++) {
    last = await probe();
    if (last) return last;
    await new Promise((r) => setTimeout(r, everyMs));
  }
  throw new Error(`never happened: ${what} (last seen: ${JSON.stringify(last)})`);
}

/// One HTTP request with a Host header of our choosing (Node's fetch forbids setting Host),
/// resolving to { status, headers, body }.
export function request(port, { method = "GET", host, path: p, headers = {}, body } = {}) {
  return new Promise((resolve, reject) => {
    const req = http.request(
      { host: "127.0.0.1", port, method, path: p, agent: false, headers: { host, ...headers } },
      (res) => {
        const chunks = [];
        res.on("data", (c) => chunks.push(c));
        res.on("end", () =>
          resolve({ status: res.statusCode, headers: res.headers, body: Buffer.concat(chunks).toString() }),
        );
        res.on("error", reject);
      },
    );
    req.on("error", reject);
    if (body !== undefined) req.write(body);
    req.end();
  });
}

function spawnLogged(bin, args, logFile) {
  const child = spawn(bin, args, { stdio: ["ignore", "pipe", "pipe"] });
  const out = [];
  child.stdout.on("data", (c) => out.push(c));
  child.stderr.on("data", (c) => out.push(c));
  child.logTail = () => Buffer.concat(out).toString().split("\n").slice(-40).join("\n");
  child.logFile = logFile;
  return child;
}

/// A pool's `[[pools]]` table in front of the sandbox, taking POOL_KEY.
export function proxyPoolToml(name, upstream, concurrency = "") {
  return `[[pools]]\nname = "${name}"\nupstream = "${upstream}"\nkeys = ["${POOL_KEY}"]\n[pools.concurrency]\n${concurrency}\n`;
}

/// Starts the sandbox origin and `nthbouncer serve` with `pools(originUrl)` as the pools' TOML,
/// and waits until the server is ready. Returns the running stack.
/// `port`: the server's port when it is free (the screenshots show 8080, as the README does);
/// any free one otherwise. `server`: more `[server]` lines (e.g. `allow_private_webhooks = true`).
export async function startStack({ pools, port: wanted, server = "" }) {
  const bin = binaryPath();
  const dir = await mkdtemp(path.join(os.tmpdir(), "nthbouncer-browser-"));
  const originPort = await freePort();
  const port = wanted && (await isFree(wanted)) ? wanted : await freePort();
  const origin = `http://127.0.0.1:${originPort}`;
  const children = [];
  const stack = {
    dir,
    port,
    origin,
    /// The dashboard's URL for `p` (Chromium resolves *.localhost to loopback).
    url: (p = "/dashboard") => `http://${API_HOST}:${port}${p}`,
    /// An admin API call with the Bearer token; JSON in, { status, json } out.
    admin: async (method, p, json) => {
      const r = await request(port, {
        method,
        host: API_HOST,
        path: p,
        headers: {
          authorization: `Bearer ${ADMIN_TOKEN}`,
          ...(json === undefined ? {} : { "content-type": "application/json" }),
        },
        body: json === undefined ? undefined : JSON.stringify(json),
      });
      let parsed = null;
      try {
        parsed = r.body ? JSON.parse(r.body) : null;
      } catch {
        parsed = r.body;
      }
      return { status: r.status, json: parsed };
    },
    /// A proxied call to pool `pool` with the pool key.
    proxied: (pool, p, headers = {}) =>
      request(port, { host: `${pool}.localhost`, path: p, headers: { "x-nthpool-key": POOL_KEY, ...headers } }),
    /// Opens `n` streams through pool `pool` that stay in flight (or queued) until released.
    hold: (pool, n) => holdStreams(port, pool, n),
    logs: () => children.map((c) => `--- ${c.spawnargs.slice(0, 2).join(" ")}\n${c.logTail()}`).join("\n"),
    stop: async () => {
      for (const c of children) c.kill("SIGKILL");
      await Promise.all(children.map((c) => (c.exitCode !== null ? null : new Promise((r) => c.once("exit", r)))));
      await rm(dir, { recursive: true, force: true });
    },
  };
  try {
    // No hidden concurrency limit at the origin: the pool's own limit is what the tests watch.
    children.push(
      spawnLogged(bin, ["sandbox", "--listen", `127.0.0.1:${originPort}`, "--limit", "0", "--latency-ms", "5"]),
    );
    const config = path.join(dir, "nthbouncer.toml");
    await writeFile(
      config,
      `[server]\nlisten = "127.0.0.1:${port}"\ndata_dir = ${JSON.stringify(path.join(dir, "data"))}\n` +
        `admin_token = "${ADMIN_TOKEN}"\n${server}\n\n${pools(origin)}`,
    );
    children.push(spawnLogged(bin, ["serve", "--config", config]));
    for (const c of children) {
      c.once("exit", (code, signal) => {
        if (signal !== "SIGKILL") console.error(`${c.spawnargs.slice(0, 2).join(" ")} exited (${code ?? signal})`);
      });
    }
    await waitUntil("the server answers /readyz", async () => {
      try {
        return (await request(port, { host: API_HOST, path: "/readyz" })).status === 200;
      } catch {
        return false;
      }
    });
    await waitUntil("the sandbox answers /healthz", async () => {
      try {
        return (await request(originPort, { host: "127.0.0.1", path: "/healthz" })).status === 200;
      } catch {
        return false;
      }
    });
  } catch (e) {
    const logs = stack.logs();
    await stack.stop();
    throw new Error(`${e.message}\n${logs}`);
  }
  return stack;
}

/// `n` long streams (the sandbox's /stream) through the proxy, each on its own connection:
/// admitted ones stay in flight, the rest wait in the pool's queue, until `release()` closes
/// them all. `answered()` counts those whose response headers arrived (admitted).
function holdStreams(port, pool, n) {
  const reqs = [];
  let answered = 0;
  for (let i = 0; i < n; i++) {
    const req = http.request({
      host: "127.0.0.1",
      port,
      path: "/stream?chunks=10000&interval_ms=1000",
      agent: false,
      headers: { host: `${pool}.localhost`, "x-nthpool-key": POOL_KEY },
    });
    req.on("response", (res) => {
      answered++;
      res.on("data", () => {});
      res.on("error", () => {});
    });
    req.on("error", () => {}); // released: the socket is destroyed on purpose
    req.end();
    reqs.push(req);
  }
  return {
    answered: () => answered,
    release: () => reqs.forEach((r) => r.destroy()),
  };
}

/// A webhook signing secret of the shape the config wants (`whsec_` + base64 of 24 bytes).
export const WEBHOOK_SECRET = `whsec_${Buffer.alloc(24, 7).toString("base64")}`;

/// A tiny webhook receiver on loopback: answers every POST `204` and counts them
/// (`received()`). Pools reach it with `allow_private_webhooks = true`.
export async function webhookReceiver() {
  let received = 0;
  const srv = http.createServer((req, res) => {
    req.on("data", () => {});
    req.on("end", () => {
      if (req.method === "POST") received++;
      res.writeHead(204).end();
    });
  });
  await new Promise((resolve) => srv.listen(0, "127.0.0.1", resolve));
  return {
    url: `http://127.0.0.1:${srv.address().port}/hook`,
    received: () => received,
    close: () => new Promise((resolve) => {
      srv.close(resolve);
      srv.closeAllConnections();
    }),
  };
}

/// Debian's Chromium (or $CHROMIUM), headless.
export async function launchBrowser() {
  return chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    headless: true,
    // Chromium's own sandbox refuses to run as root (CI runs as root).
    args: ["--no-sandbox"],
  });
}

/// A fresh browser context (its own cookies) at the screenshots' size.
export async function newPage(browser, { colorScheme = "light" } = {}) {
  const context = await browser.newContext({ viewport: { width: 1280, height: 800 }, colorScheme });
  const page = await context.newPage();
  return { context, page };
}

/// Logs in with the admin token through the form, by keyboard, and lands on the pool list.
export async function logIn(stack, page, token = ADMIN_TOKEN) {
  await page.goto(stack.url("/dashboard/login"));
  await page.getByLabel("Admin token").fill(token);
  await page.getByLabel("Admin token").press("Enter");
  await page.waitForLoadState("load");
}

const axeSource = readFile(require.resolve("axe-core/axe.min.js"), "utf8");

/// The widths axe-core checks each page at: the screenshots' desktop and a phone (where wide
/// tables and long examples scroll sideways).
const AXE_WIDTHS = [1280, 375];

/// Runs axe-core (all its rules but the experimental ones) on the page as it is, at each of
/// AXE_WIDTHS in light and in dark colour schemes (the stylesheet has both), and returns the
/// serious and critical violations found, as readable lines.
export async function axeViolations(page) {
  const source = await axeSource;
  const viewport = page.viewportSize();
  const found = [];
  for (const width of AXE_WIDTHS) {
    await page.setViewportSize({ width, height: viewport.height });
    for (const colorScheme of ["light", "dark"]) {
      await page.emulateMedia({ colorScheme });
      if (!(await page.evaluate(() => typeof window.axe !== "undefined"))) {
        await page.addScriptTag({ content: source });
      }
      const violations = await page.evaluate(async () => {
        const r = await window.axe.run(document, { resultTypes: ["violations"] });
        return r.violations.map((v) => ({
          id: v.id,
          impact: v.impact,
          help: v.help,
          targets: v.nodes.map((n) => `${n.target.join(" ")}: ${n.failureSummary}`),
        }));
      });
      for (const v of violations) {
        if (v.impact === "serious" || v.impact === "critical") {
          found.push(`[${width}px, ${colorScheme}] ${v.impact} ${v.id} (${v.help}):\n    ${v.targets.join("\n    ")}`);
        }
      }
    }
  }
  await page.setViewportSize(viewport);
  await page.emulateMedia({ colorScheme: null });
  return found;
}
