-- "Replays": requests cycle through a fixed set of keys that were stored beforehand, so each
-- one is answered from the store without calling the upstream.
-- Usage: wrk -t2 -c32 -d5s -s bench/replay_keys.lua http://127.0.0.1:PORT -- PREFIX COUNT
-- Keys are PREFIX-0 … PREFIX-(COUNT-1); send each once first (bench/runner.py pre-warms them).

local common = dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "wrk_common.lua")

local threads = 0
function setup(thread)
   threads = threads + 1
   thread:set("id", threads)
end

local prefix = "replay"
local count = 64
local next_key = 0

function init(args)
   prefix = args[1] or prefix
   count = tonumber(args[2]) or count
   next_key = ((id or 1) * 7) % count -- threads start at different keys
end

function request()
   local key = string.format("%s-%d", prefix, next_key)
   next_key = (next_key + 1) % count
   return common.post(key)
end

done = common.done
