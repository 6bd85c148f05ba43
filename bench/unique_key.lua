-- "New keys": every request carries an Idempotency-Key never sent before, so each one is a
-- claim, an upstream call and a completion write.
-- Usage: wrk -t2 -c32 -d5s -s bench/unique_key.lua http://127.0.0.1:PORT -- PREFIX
-- Keys are PREFIX-THREAD-COUNTER; pick a PREFIX unique to the run (the harness does).

local common = dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "wrk_common.lua")

-- setup() runs in the main Lua state once per thread; `id` becomes a global of that thread.
local threads = 0
function setup(thread)
   threads = threads + 1
   thread:set("id", threads)
end

local prefix = "bench"
local counter = 0

function init(args)
   prefix = args[1] or prefix
end

function request()
   counter = counter + 1
   return common.post(string.format("%s-%d-%d", prefix, id, counter))
end

done = common.done
