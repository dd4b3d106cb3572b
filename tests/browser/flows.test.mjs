// The dashboard's per-pool flows in headless Chromium against the real binary (issue #18):
// create a pool, create a key (shown once) and use it through the proxy, change a limit under
// load, deactivate and re-enable a webhook destination, read an async job's result, and the
// access log's rows and filter. axe-core runs on every page reached. Run by tests/browser/run.
//
// Every wait is a bounded poll on what a page or an answer shows, never a timing assert.

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import {
  API_HOST,
  POOL_KEY,
  WEBHOOK_SECRET,
  axeViolations,
  launchBrowser,
  logIn,
  newPage,
  proxyPoolToml,
  request,
  startStack,
  waitUntil,
  webhookReceiver,
} from "./harness.mjs";

let stack;
let browser;
let receiver;

/// A pool with async jobs on and one webhook destination at the test's receiver.
function asyncPoolToml(name, origin, hookUrl) {
  return (
    proxyPoolToml(name, origin) +
    `[pools.async]\nenabled = true\n` +
    `[[pools.webhooks]]\nurl = "${hookUrl}"\nsecret = "${WEBHOOK_SECRET}"\n`
  );
}

before(async () => {
  receiver = await webhookReceiver();
  stack = await startStack({
    server: "allow_private_webhooks = true",
    pools: (origin) =>
      proxyPoolToml("alpha", origin) +
      // hooks: its destination is switched off and on; jobs: its jobs are read (never switched
      // off, so its async path stays on).
      asyncPoolToml("hooks", origin, receiver.url) +
      asyncPoolToml("jobs", origin, receiver.url),
  });
  browser = await launchBrowser();
});

after(async () => {
  await browser?.close();
  await stack?.stop();
  await receiver?.close();
});

/// Fails with axe-core's serious and critical violations on `page`, if any.
async function assertAccessible(page, what) {
  const violations = await axeViolations(page);
  assert.deepEqual(violations, [], `${what}: accessibility violations:\n${violations.join("\n")}`);
}

/// A call through pool `pool`'s host with `key` (or none).
function proxiedWith(pool, path, key, { method = "GET", headers = {}, body } = {}) {
  return request(stack.port, {
    method,
    host: `${pool}.localhost`,
    path,
    headers: { ...(key ? { "x-nthpool-key": key } : {}), ...headers },
    body,
  });
}

/// The text of test id `id` in the pool row of `pool` on `page`.
function live(page, pool, id) {
  return page.locator(`tr[data-pool="${pool}"] [data-testid="${id}"]`).textContent();
}

describe("the dashboard's per-pool pages in Chromium", () => {
  test("create a pool from the pool list: a wrong name is refused by its field, a right one listed", async () => {
    const { context, page } = await newPage(browser);
    await logIn(stack, page);
    const form = page.getByTestId("create-pool");
    await form.getByLabel("Name").fill("Not a name!");
    await form.getByLabel("Upstream URL").fill(stack.origin);
    await form.getByRole("button", { name: "Create pool" }).click();
    await page.getByTestId("error-name").waitFor();
    assert.equal(await page.getByTestId("field-name").getAttribute("aria-invalid"), "true");
    assert.equal(await page.getByTestId("field-name").inputValue(), "Not a name!", "the typed name is kept");
    await assertAccessible(page, "the create-pool form with an error");

    await page.getByTestId("field-name").fill("created");
    await page.getByTestId("field-limit").fill("3");
    await page.getByRole("button", { name: "Create pool" }).click();
    await page.waitForURL((u) => u.pathname === "/dashboard/pools/created");
    await page.getByRole("heading", { name: "created · Overview" }).waitFor();
    await page.goto(stack.url("/dashboard"));
    await page.getByRole("table", { name: "Pools" }).getByRole("rowheader", { name: "created" }).waitFor();
    assert.equal(await live(page, "created", "limit"), "3");
    await assertAccessible(page, "the pool list with the new pool");
    await context.close();
  });

  test("create a key: shown once, works through the proxy, refused once revoked", async () => {
    const { context, page } = await newPage(browser);
    await logIn(stack, page);
    await page.goto(stack.url("/dashboard/pools/alpha/keys"));
    await page.getByRole("heading", { name: "alpha · Keys" }).waitFor();
    await page.getByTestId("field-label").fill("browser test");
    await page.getByRole("button", { name: "Create key" }).click();
    const key = (await page.getByTestId("new-key").textContent()).trim();
    assert.ok(key.length >= 20, `a key: ${key}`);
    await assertAccessible(page, "the Keys page with a new key");

    // Shown once: the page read again has the key's row but not the key.
    await page.goto(stack.url("/dashboard/pools/alpha/keys"));
    await page.getByTestId("key-row").first().waitFor();
    assert.equal(await page.getByTestId("new-key").count(), 0);
    assert.ok(!(await page.content()).includes(key), "the key is shown again");
    await assertAccessible(page, "the Keys page");

    assert.equal((await proxiedWith("alpha", "/echo", key)).status, 200, "the new key is refused");

    const row = page.locator('[data-testid="key-row"]', { hasText: "browser test" });
    await row.getByTestId("revoke-key").click();
    await page.getByTestId("notice").waitFor();
    assert.equal(await row.getByTestId("key-state").textContent(), "revoked");
    await waitUntil("the revoked key refused", async () => (await proxiedWith("alpha", "/echo", key)).status === 401);
    assert.equal((await proxiedWith("alpha", "/echo", POOL_KEY)).status, 200, "the other key still works");
    await context.close();
  });

  test("change the limit on the Concurrency page under load: the live state follows", async () => {
    const made = await stack.admin("POST", "/admin/pools", {
      name: "tuned",
      upstream: stack.origin,
      keys: [POOL_KEY],
      concurrency: { limit: 2, queue_timeout_ms: 600000 },
    });
    assert.equal(made.status, 201, JSON.stringify(made.json));
    const { context, page } = await newPage(browser);
    await logIn(stack, page);
    await page.goto(stack.url("/dashboard/pools/tuned/concurrency"));
    await page.getByRole("heading", { name: "tuned · Concurrency" }).waitFor();
    assert.equal(await page.getByTestId("field-limit").inputValue(), "2");
    await assertAccessible(page, "the Concurrency page");

    // Five long streams against a limit of 2: two in flight, three queued.
    const held = stack.hold("tuned", 5);
    try {
      await waitUntil("two streams admitted", () => held.answered() === 2);
      await waitUntil(
        "the live row shows 2 / 2 and 3 queued",
        async () => (await live(page, "tuned", "in-flight")) === "2" && (await live(page, "tuned", "queued")) === "3",
      );
      await page.getByTestId("field-limit").fill("4");
      await page.getByRole("button", { name: "Save settings" }).click();
      await page.getByTestId("notice").waitFor();
      assert.equal(new URL(page.url()).searchParams.get("saved"), "1");
      await waitUntil("two more streams admitted", () => held.answered() === 4);
      await waitUntil(
        "the live row shows 4 / 4 and 1 queued",
        async () =>
          (await live(page, "tuned", "in-flight")) === "4" &&
          (await live(page, "tuned", "limit")) === "4" &&
          (await live(page, "tuned", "queued")) === "1",
      );
      assert.equal(await page.getByTestId("field-limit").inputValue(), "4");
    } finally {
      held.release();
    }
    await waitUntil("the live row shows the pool idle", async () => (await live(page, "tuned", "in-flight")) === "0");

    // A refused value: the API's message by its field, the typed values kept, nothing applied.
    await page.getByTestId("field-min_limit").fill("9");
    await page.getByRole("button", { name: "Save settings" }).click();
    await page.getByTestId("error-min_limit").waitFor();
    assert.equal(await page.getByTestId("field-min_limit").getAttribute("aria-invalid"), "true");
    assert.equal(await page.getByTestId("field-min_limit").inputValue(), "9");
    assert.equal((await stack.admin("GET", "/admin/pools/tuned/state")).json.effectiveLimit, 4);
    await assertAccessible(page, "the Concurrency page with an error");
    await context.close();
  });

  test("a config pool's Concurrency page is read-only", async () => {
    const { context, page } = await newPage(browser);
    await logIn(stack, page);
    await page.goto(stack.url("/dashboard/pools/alpha/concurrency"));
    await page.getByTestId("read-only").waitFor();
    assert.equal(await page.getByRole("button", { name: "Save settings" }).count(), 0);
    assert.ok(await page.getByTestId("field-limit").isDisabled());
    await context.close();
  });

  test("deactivate and re-enable a webhook destination", async () => {
    const { context, page } = await newPage(browser);
    await logIn(stack, page);
    await page.goto(stack.url("/dashboard/pools/hooks/webhooks"));
    await page.getByRole("heading", { name: "hooks · Webhooks" }).waitFor();
    const row = page.getByTestId("destination-row");
    assert.equal(await row.count(), 1);
    assert.equal(await row.getByTestId("destination-state").textContent(), "active");
    assert.ok(!(await page.content()).includes(WEBHOOK_SECRET), "the secret is shown");
    await assertAccessible(page, "the Webhooks page");

    await row.getByRole("button", { name: "Deactivate" }).click();
    await page.getByTestId("notice").waitFor();
    assert.equal(await row.getByTestId("destination-state").textContent(), "inactive");
    // With no active destination the pool takes no jobs: the async header is ignored.
    const direct = await proxiedWith("hooks", "/echo", POOL_KEY, { headers: { "x-nthpool-async": "1" } });
    assert.equal(direct.status, 200, direct.body);
    await assertAccessible(page, "the Webhooks page with an inactive destination");

    await row.getByRole("button", { name: "Re-enable" }).click();
    await page.waitForURL((u) => u.searchParams.get("done") === "enabled");
    assert.equal(await row.getByTestId("destination-state").textContent(), "active");
    const job = await proxiedWith("hooks", "/echo", POOL_KEY, { headers: { "x-nthpool-async": "1" } });
    assert.equal(job.status, 202, job.body);
    // The job's delivery to the re-enabled destination, listed with the receiver's status.
    const { jobId } = JSON.parse(job.body);
    const attempt = page.locator('[data-testid="attempt-row"]', { hasText: jobId });
    await waitUntil("the delivery attempt listed", async () => {
      await page.goto(stack.url("/dashboard/pools/hooks/webhooks"));
      return (await attempt.count()) === 1;
    });
    assert.equal(await attempt.getByTestId("attempt-status").textContent(), "204");
    await assertAccessible(page, "the Webhooks page with an attempt");
    await context.close();
  });

  test("read a job's result: an async call through the proxy, listed, filtered, opened", async () => {
    const accepted = await proxiedWith("jobs", "/echo?marker=browser-job", POOL_KEY, {
      method: "POST",
      headers: { "x-nthpool-async": "1", "content-type": "text/plain" },
      body: "hello from the browser test",
    });
    assert.equal(accepted.status, 202, accepted.body);
    const { jobId } = JSON.parse(accepted.body);

    const { context, page } = await newPage(browser);
    await logIn(stack, page);
    const row = page.locator(`[data-testid="job-row"][data-job-id="${jobId}"]`);
    await waitUntil("the job listed as completed", async () => {
      await page.goto(stack.url("/dashboard/pools/jobs/jobs"));
      return (await row.count()) === 1 && (await row.getByTestId("job-status").textContent()) === "completed";
    });
    await assertAccessible(page, "the Jobs page");

    // The status filter: the job is among the completed ones, not the failed ones.
    await page.getByTestId("field-status").selectOption("failed");
    await page.getByTestId("job-filter").getByRole("button").click();
    await page.waitForURL((u) => u.searchParams.get("status") === "failed");
    assert.equal(await row.count(), 0);
    await page.getByTestId("field-status").selectOption("completed");
    await page.getByTestId("job-filter").getByRole("button").click();
    await page.waitForURL((u) => u.searchParams.get("status") === "completed");
    assert.equal(await row.count(), 1);

    await row.getByRole("link").first().click();
    await page.getByTestId("job-result").waitFor();
    assert.equal((await page.getByTestId("job-id").textContent()).trim(), jobId);
    assert.equal((await page.getByTestId("job-result-status").textContent()).trim(), "200");
    const body = await page.getByTestId("job-result-body").textContent();
    assert.ok(body.includes("browser-job"), body);
    assert.ok((await page.getByTestId("job-event").count()) > 0, "the job's history is shown");
    await assertAccessible(page, "a job's page");
    await context.close();
  });

  test("the access log shows the calls made, filtered by outcome", async () => {
    for (let i = 0; i < 3; i++) assert.equal((await proxiedWith("alpha", "/echo", POOL_KEY)).status, 200);
    assert.equal((await proxiedWith("alpha", "/echo", "not-a-key-of-this-pool-0123456789")).status, 401);

    const { context, page } = await newPage(browser);
    await logIn(stack, page);
    await waitUntil("the log shows the calls", async () => {
      await page.goto(stack.url("/dashboard/pools/alpha/access-log"));
      return (await page.getByTestId("log-outcome").allTextContents()).filter((o) => o === "401").length >= 1;
    });
    assert.ok((await page.getByTestId("log-row").count()) >= 4);
    await assertAccessible(page, "the Access log page");

    await page.getByTestId("field-outcome").fill("401");
    await page.getByTestId("log-filter").getByRole("button", { name: "Filter" }).click();
    await page.waitForURL((u) => u.searchParams.get("outcome") === "401");
    const outcomes = await page.getByTestId("log-outcome").allTextContents();
    assert.ok(outcomes.length >= 1 && outcomes.every((o) => o === "401"), outcomes.join(", "));
    await context.close();
  });
});
