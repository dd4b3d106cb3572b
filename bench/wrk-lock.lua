-- wrk script for bench/instructions: lock API pairs on pool `p`. Each connection acquires a slot,
-- then releases the slot it was granted (ids are kept per wrk thread; the limit is far above
-- the connections, so every acquire is granted at once). NB_KEY is the pool key.
local key = os.getenv("NB_KEY")
local granted = {}

request = function()
  local headers = { ["Host"] = "api.localhost", ["x-nthpool-key"] = key }
  local id = table.remove(granted)
  if id then
    return wrk.format("POST", "/pools/p/lock/" .. id .. "/release", headers, "")
  end
  headers["content-type"] = "application/json"
  return wrk.format("POST", "/pools/p/lock/acquire", headers, "{}")
end

response = function(status, headers, body)
  local id = body:match('"slotId"%s*:%s*"(%x+)"')
  if id then
    table.insert(granted, id)
  end
end
