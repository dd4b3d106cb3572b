// The official @neondatabase/serverless HTTP driver (pinned in package-lock.json), unchanged
// but for its endpoint: a database pool's own listener. Prints one JSON line of checks for
// crates/nthbouncer/tests/it/sdk.rs. Usage: node neon.mjs http://127.0.0.1:PORT/sql POOL_KEY
import { neon, neonConfig, NeonDbError } from "@neondatabase/serverless";

const [endpoint, key] = process.argv.slice(2);
neonConfig.fetchEndpoint = endpoint;
// The driver wants a connection string and sends it as Neon-Connection-String; the pool ignores
// it (it holds its own credential). The pool key goes as the driver's authToken (a Bearer token).
const sql = neon("postgresql://driver:not-the-password@db.invalid/neondb", { authToken: key });
const checks = {};

// A query: rows as objects, values parsed by type id (a timestamptz becomes a Date).
const [row] = await sql`SELECT 1::int AS one, 'x'::text AS t, now() AS ts, '{"k": [1]}'::jsonb AS j`;
checks.query = row.one === 1 && row.t === "x" && row.ts instanceof Date && row.j.k[0] === 1;

// Parameterised: a tagged template, and sql.query with $n placeholders.
const n = 41;
const [p] = await sql`SELECT ${n}::int + 1 AS answer, ${"it's"}::text AS s`;
const [q] = await sql.query("SELECT $1::int8 AS big, $2::text[] AS arr", ["9007199254740993", ["a", "b"]]);
checks.params = p.answer === 42 && p.s === "it's" && q.big === "9007199254740993" && q.arr.join() === "a,b";

// A transaction batch: one session, one transaction (a temporary table lives through it).
const [, , counted] = await sql.transaction(
  [
    sql`CREATE TEMP TABLE driver_t (id int PRIMARY KEY) ON COMMIT DROP`,
    sql`INSERT INTO driver_t VALUES (1), (2)`,
    sql`SELECT count(*)::int AS n FROM driver_t`,
  ],
  { isolationLevel: "Serializable" },
);
checks.transaction = counted[0].n === 2;

// A batch that fails rolls back whole: the table its first statement made is not there.
const table = `nb_driver_${process.pid}_${Date.now()}`;
let failed;
try {
  await sql.transaction([sql.query(`CREATE TABLE ${table} (id int)`), sql`SELECT 1 / 0`]);
} catch (e) {
  failed = e;
}
const [gone] = await sql.query("SELECT to_regclass($1) IS NULL AS gone", [table]);
checks.rollback = failed instanceof NeonDbError && failed.code === "22012" && gone.gone === true;

// An error: NeonDbError with PostgreSQL's fields.
try {
  await sql`SELECT * FROM no_such_table_for_the_driver`;
  checks.error = false;
} catch (e) {
  checks.error = e instanceof NeonDbError && e.code === "42P01" && typeof e.position === "string";
}

console.log(JSON.stringify(checks));
