-- batch: ARGV 13 the number of operations, then each operation: its name ('acquire' or
-- 'release') and its arguments as its own script takes them (acquire: 9; release: 5, and the 7
-- of what was learned when it learns; a release's `granted` is '' for a tracked slot). Runs them in order as one call (see ops.lua).
-- Returns one reply per operation, each what its own script returns.
local replies = {}
local i = 14
for k = 1, tonumber(ARGV[13]) do
  if ARGV[i] == 'acquire' then
    replies[k] = op_acquire(ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4]),
      ARGV[i + 5] == '1', tonumber(ARGV[i + 6]), tonumber(ARGV[i + 7]), tonumber(ARGV[i + 8]),
      ARGV[i + 9] == '1')
    i = i + 10
  elseif ARGV[i] == 'release' then
    local learn = ARGV[i + 2] == '1'
    replies[k] = op_release(ARGV[i + 1], learn, ARGV[i + 3] == '1', ARGV[i + 4] == '1',
      tonumber(ARGV[i + 5]), i + 6)
    i = i + 6
    if learn then i = i + 7 end
  else
    return redis.error_reply('batch: unknown operation ' .. tostring(ARGV[i]))
  end
end
return replies
