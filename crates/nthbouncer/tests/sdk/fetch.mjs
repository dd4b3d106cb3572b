// Node's fetch against a pool's own listener: fetch forbids setting Host, so a pool host name
// cannot be used; the pool's listener needs none. Prints one line for tests/it/sdk.rs.
const [base, key] = process.argv.slice(2);
const r = await fetch(`${base}/v1/chat/completions`, {
  method: "POST",
  headers: { "X-Nthpool-Key": key, "content-type": "application/json" },
  body: JSON.stringify({ model: "demo", messages: [{ role: "user", content: "hello from node" }] }),
});
const body = await r.json();
console.log("fetch", r.status, body.object ?? "-", Boolean(body.choices?.[0]?.message?.content));
