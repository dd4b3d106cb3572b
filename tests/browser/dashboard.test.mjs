// The dashboard in headless Chromium against the real binary (issue #18): log in, the pool list
// and a pool's Overview following live load, axe-core on every page reached, log out and be
// refused. Run by tests/browser/run (README: "Browser tests"). Flows for pages not built yet are
// listed in tests/browser/README.md, not faked here.
//
// Every wait is a bounded poll on what the page shows (counts and text), never a timing assert.

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import {
  ADMIN_TOKEN,
  axeViolations,
  launchBrowser,
  logIn,
  newPage,
  proxyPoolToml,
  startStack,
  waitUntil,
} from "./harness.mjs";

let stack;
let browser;

before(async () => {
  stack = await startStack({
    pools: (origin) =>
      // alpha: a small limit and a long queue, so held streams show as in flight and queued.
      proxyPoolToml("alpha", origin, "limit = 2\nqueue_timeout_ms = 600000") + proxyPoolToml("beta", origin),
  });
  browser = await launchBrowser();
});

after(async () => {
  await browser?.close();
  await stack?.stop();
});

/// Fails with axe-core's serious and critical violations on `page`, if any.
async function assertAccessible(page, what) {
  const violations = await axeViolations(page);
  assert.deepEqual(violations, [], `${what}: accessibility violations:\n${violations.join("\n")}`);
}

/// The text of a pool list cell (`tr[data-pool] [data-field]`).
function cell(page, pool, field) {
  return page.locator(`tr[data-pool="${pool}"] [data-field="${field}"]`).textContent();
}

describe("the dashboard in Chromium", () => {
  test("without a session every page sends the browser to the login form", async () => {
    const { context, page } = await newPage(browser);
    for (const p of ["/dashboard", "/dashboard/pools/alpha"]) {
      await page.goto(stack.url(p));
      assert.equal(new URL(page.url()).pathname, "/dashboard/login", p);
    }
    await assertAccessible(page, "the login form");
    await context.close();
  });

  test("a wrong token is refused with an alert, and is not echoed", async () => {
    const { context, page } = await newPage(browser);
    await logIn(stack, page, "not-the-admin-token");
    assert.equal(new URL(page.url()).pathname, "/dashboard/login");
    await page.getByRole("alert").waitFor();
    assert.match(await page.getByRole("alert").textContent(), /not the admin token/);
    assert.ok(!(await page.content()).includes("not-the-admin-token"), "the wrong token is echoed");
    assert.deepEqual(await context.cookies(), [], "a cookie was set for a wrong token");
    await assertAccessible(page, "the login form with an error");
    await context.close();
  });

  test("log in: the pool list shows every pool with its limit", async () => {
    const { context, page } = await newPage(browser);
    await logIn(stack, page);
    assert.equal(new URL(page.url()).pathname, "/dashboard");
    await page.getByRole("heading", { name: "Pools" }).waitFor();
    const table = page.getByRole("table", { name: "Pools" });
    for (const pool of ["alpha", "beta"]) {
      await table.getByRole("rowheader", { name: pool }).waitFor();
    }
    assert.equal(await cell(page, "alpha", "load"), "0 / 2");
    assert.equal(await cell(page, "beta", "load"), "0 / 10");
    const [cookie] = await context.cookies();
    assert.equal(cookie.httpOnly, true);
    assert.equal(cookie.sameSite, "Strict");
    await assertAccessible(page, "the pool list");
    await context.close();
  });

  test("a pool's Overview has examples for its own host and a chart", async () => {
    const { context, page } = await newPage(browser);
    await logIn(stack, page);
    await page.getByRole("link", { name: "alpha" }).click();
    await page.getByRole("heading", { name: "Overview" }).waitFor();
    assert.equal(new URL(page.url()).pathname, "/dashboard/pools/alpha");
    const examples = await page.locator("pre code").allTextContents();
    assert.ok(
      examples.some((e) => e.includes(`http://api.localhost:${stack.port}/pools/alpha/lock/acquire`)),
      examples.join("\n"),
    );
    assert.ok(examples.every((e) => !e.includes(ADMIN_TOKEN)), "the admin token is shown");
    await page.locator("#history-chart").waitFor();
    await assertAccessible(page, "a pool's Overview");
    await context.close();
  });

  test("the pool list and the Overview follow live load through the proxy", async () => {
    const { context, page } = await newPage(browser);
    await logIn(stack, page);
    const overview = await context.newPage();
    await overview.goto(stack.url("/dashboard/pools/alpha"));
    const admittedBefore = Number(await overview.locator('[data-total="admitted"]').textContent());

    // Five long streams against a limit of 2: two in flight, three queued.
    const held = stack.hold("alpha", 5);
    try {
      await waitUntil("two streams admitted", () => held.answered() === 2);
      await waitUntil(
        "the pool list shows 2 in flight and 3 queued",
        async () => (await cell(page, "alpha", "load")) === "2 / 2" && (await cell(page, "alpha", "queued")) === "3",
      );
      assert.equal(await cell(page, "beta", "load"), "0 / 10", "the other pool is idle");
      await waitUntil("the Overview's chart counts the two admissions", async () => {
        const admitted = Number(await overview.locator('[data-total="admitted"]').textContent());
        return admitted >= admittedBefore + 2;
      });
    } finally {
      held.release();
    }
    await waitUntil(
      "the pool list shows the pool idle again",
      async () => (await cell(page, "alpha", "load")) === "0 / 2" && (await cell(page, "alpha", "queued")) === "0",
    );
    await context.close();
  });

  test("the pool list and an Overview can be used by keyboard alone", async () => {
    const { context, page } = await newPage(browser);
    await logIn(stack, page);
    // Tab through the pool list: its controls are reached in the order they are read.
    const focused = () => page.evaluate(() => document.activeElement.textContent.trim());
    const reached = [];
    while (!reached.includes("beta") && reached.length < 30) {
      await page.keyboard.press("Tab");
      reached.push(await focused());
    }
    const order = ["nthbouncer", "Log out", "alpha", "beta"].map((name) => reached.indexOf(name));
    assert.ok(
      order.every((at, i) => at >= 0 && (i === 0 || at > order[i - 1])),
      `tab order: ${reached.join(" → ")}`,
    );
    // Back to "alpha" and into its Overview with Enter.
    while ((await focused()) !== "alpha") await page.keyboard.press("Shift+Tab");
    await page.keyboard.press("Enter");
    await page.getByRole("heading", { name: "Overview" }).waitFor();
    assert.equal(new URL(page.url()).pathname, "/dashboard/pools/alpha");
    // Each example can be focused (to scroll it sideways on a narrow screen).
    const examples = await page.locator("pre").count();
    assert.ok(examples > 0);
    assert.equal(await page.locator('pre[tabindex="0"]').count(), examples);
    await context.close();
  });

  test("log out: the dashboard and its API refuse the old session", async () => {
    const { context, page } = await newPage(browser);
    await logIn(stack, page);
    const [session] = await context.cookies();
    assert.equal(session.name, "nb_dashboard");
    // A second tab on the pool list, polling.
    const other = await context.newPage();
    await other.goto(stack.url("/dashboard"));
    await other.getByRole("table", { name: "Pools" }).waitFor();

    await page.getByRole("button", { name: "Log out" }).click();
    await page.waitForURL((u) => u.pathname === "/dashboard/login");
    assert.deepEqual(await context.cookies(), [], "the cookie was not cleared");
    // The other tab's next poll is refused, and its script sends it to the login form.
    await other.waitForURL((u) => u.pathname === "/dashboard/login");

    // The browser's own cookie is gone; the old one, sent again, opens nothing either.
    await context.addCookies([session]);
    await page.goto(stack.url("/dashboard"));
    assert.equal(new URL(page.url()).pathname, "/dashboard/login");
    await page.goto(stack.url("/dashboard/pools/alpha"));
    assert.equal(new URL(page.url()).pathname, "/dashboard/login");
    // The page's own poll, as its script makes it, with the old cookie.
    const api = await page.evaluate(async () => {
      const r = await fetch("/dashboard/api/pools", { credentials: "same-origin" });
      return { status: r.status, body: await r.json() };
    });
    assert.equal(api.status, 401);
    assert.equal(api.body.error, "unauthorized");
    await context.close();
  });
});
