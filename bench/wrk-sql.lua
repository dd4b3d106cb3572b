-- wrk as a client of a database pool's POST /sql (bench/run database): the query mix pgbench
-- runs on the PostgreSQL side, one query per request, alternating per connection thread:
-- `SELECT $1::int` with a fresh parameter, then the 10-row read of the bench table. Headers as
-- the @neondatabase/serverless driver sends them (array mode, raw text). The caller passes Host
-- and Authorization with -H. The summary line comes from wrk-report.lua, next to this file.
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "wrk-report.lua")

-- wrk.format uses the table it is given instead of the -H headers, so they are copied in.
local headers = {}
for k, v in pairs(wrk.headers) do
  headers[k] = v
end
headers["Content-Type"] = "application/json"
headers["Neon-Array-Mode"] = "true"
headers["Neon-Raw-Text-Output"] = "true"

local n = 0
local table_read = '{"query":"SELECT id, name, price FROM bench_items ORDER BY id LIMIT 10","params":[]}'

request = function()
  n = n + 1
  local body
  if n % 2 == 1 then
    body = string.format('{"query":"SELECT $1::int","params":["%d"]}', math.random(1, 1000000))
  else
    body = table_read
  end
  return wrk.format("POST", "/sql", headers, body)
end
