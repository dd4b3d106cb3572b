-- learn: ARGV 13 apply (0/1), 14..20 what was learned (see `apply_learned`). With apply = 0,
-- only reads what a learner needs for an outcome not tied to a slot.
-- Returns {now, bound (0/1): the limit binds now}.
if ARGV[13] == '1' then
  apply_learned(14)
  settle()
  publish()
end
local bound = 0
if in_flight() >= eff then bound = 1 end
return { now, bound }
