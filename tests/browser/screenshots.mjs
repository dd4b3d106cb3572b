// Screenshots of each dashboard page for the README (issue #18), taken from the real binary in
// headless Chromium at 1280x800 and written to docs/screenshots/. Not a test: run it by hand
// after changing a page, and commit the PNGs.
//
//   tests/browser/run --screenshots      (builds the binary and installs the packages first)
//   node tests/browser/screenshots.mjs   (with the binary built and `npm ci` done)

import { mkdir } from "node:fs/promises";
import path from "node:path";

import {
  POOL_KEY,
  WEBHOOK_SECRET,
  launchBrowser,
  logIn,
  newPage,
  proxyPoolToml,
  repoRoot,
  request,
  startStack,
  waitUntil,
  webhookReceiver,
} from "./harness.mjs";

const out = process.env.SCREENSHOTS_DIR || path.join(repoRoot, "docs", "screenshots");

// The Webhooks and Jobs pages need a destination: a receiver on loopback.
const receiver = await webhookReceiver();
const stack = await startStack({
  port: 8080,
  server: "allow_private_webhooks = true",
  pools: (origin) =>
    proxyPoolToml("openai", origin, "limit = 4\nqueue_timeout_ms = 600000") +
    `[pools.async]\nenabled = true\n[[pools.webhooks]]\nurl = "${receiver.url}"\nsecret = "${WEBHOOK_SECRET}"\n` +
    proxyPoolToml("partner-api", origin, "limit = 8") +
    proxyPoolToml("search", origin, "limit = 2"),
});
const browser = await launchBrowser();
const held = [];
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
try {
  await mkdir(out, { recursive: true });
  // Forty seconds of history for the chart: a wave of calls admitted each second, and every
  // eighth second a burst against a full pool, some waiting in its queue and some refused
  // (`X-Nthpool-No-Queue`).
  for (let second = 0; second < 40; second++) {
    const calls = 4 + Math.round(4 * Math.sin(second / 4));
    const burst = second % 8 === 7;
    const full = burst ? stack.hold("openai", 6) : null;
    if (full) await waitUntil("the pool full", () => full.answered() === 4);
    await Promise.all([
      ...Array.from({ length: burst ? 0 : calls }, () => stack.proxied("openai", "/echo")),
      ...Array.from({ length: burst ? 3 : 0 }, () => stack.proxied("openai", "/echo", { "x-nthpool-no-queue": "1" })),
    ]);
    full?.release();
    await sleep(1000);
  }
  for (let i = 0; i < 6; i++) await stack.proxied("search", "/echo");
  // A few async jobs (their results and webhook deliveries) and a refused key for the log.
  const jobIds = [];
  for (let i = 0; i < 3; i++) {
    const r = await request(stack.port, {
      method: "POST",
      host: "openai.localhost",
      path: "/echo/v1/chat/completions",
      headers: { "x-nthpool-key": POOL_KEY, "x-nthpool-async": "1", "content-type": "application/json" },
      body: JSON.stringify({ model: "gpt-4o-mini", messages: [{ role: "user", content: `job ${i}` }] }),
    });
    jobIds.push(JSON.parse(r.body).jobId);
  }
  await stack.proxied("openai", "/echo", { "x-nthpool-key": "not-a-key-of-this-pool-0123456789" });
  await waitUntil("the jobs delivered", () => receiver.received() >= 3);
  // An origin 429 on another pool: it lowers that pool's learned limit and shows as its last
  // throttle.
  await stack.proxied("search", "/status/429?retry_after=1");
  // Live load: six streams on a limit of 4 (four in flight, two queued), one on partner-api.
  held.push(stack.hold("openai", 6), stack.hold("partner-api", 1));
  await waitUntil("the streams admitted", () => held[0].answered() === 4 && held[1].answered() === 1);

  const { page } = await newPage(browser);
  const shot = async (name) => {
    const file = path.join(out, `${name}.png`);
    await page.screenshot({ path: file });
    console.log(`wrote ${path.relative(repoRoot, file)}`);
  };

  await page.goto(stack.url("/dashboard/login"));
  await shot("login");

  await logIn(stack, page);
  await waitUntil("the pool list shows the load", async () => {
    const load = await page.locator('tr[data-pool="openai"] [data-field="load"]').textContent();
    const queued = await page.locator('tr[data-pool="openai"] [data-field="queued"]').textContent();
    return load === "4 / 4" && queued === "2";
  });
  await shot("pools");

  await page.goto(stack.url("/dashboard/pools/openai"));
  await page.locator("#history-chart").waitFor();
  await shot("pool-overview");

  await page.goto(stack.url("/dashboard/pools/openai/concurrency"));
  await page.getByTestId("concurrency-form").waitFor();
  await shot("pool-concurrency");

  await page.goto(stack.url("/dashboard/pools/openai/keys"));
  await page.getByTestId("field-label").fill("batch worker");
  await page.getByRole("button", { name: "Create key" }).click();
  await page.getByTestId("new-key").waitFor();
  await shot("pool-keys");

  await page.goto(stack.url("/dashboard/pools/openai/webhooks"));
  await page.getByTestId("attempt-row").first().waitFor();
  await shot("pool-webhooks");

  await page.goto(stack.url("/dashboard/pools/openai/jobs"));
  await page.getByTestId("job-row").first().waitFor();
  await shot("pool-jobs");

  await page.goto(stack.url(`/dashboard/pools/openai/jobs/${jobIds[0]}`));
  await page.getByTestId("job-result-status").waitFor();
  await shot("pool-job");

  await page.goto(stack.url("/dashboard/pools/openai/access-log"));
  await page.getByTestId("log-row").first().waitFor();
  await shot("pool-access-log");
} finally {
  held.forEach((h) => h.release());
  await browser.close();
  await stack.stop();
  await receiver.close();
}
