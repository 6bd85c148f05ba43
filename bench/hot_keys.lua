-- "Hot-key storm": every connection hammers the same few keys at once, so most requests are
-- duplicates of a key whose first request is still running (held, then replayed) or done
-- (replayed). Each key is replaced by a new one after ROUNDS requests for it.
-- Usage: wrk -t2 -c32 -d5s -s bench/hot_keys.lua http://127.0.0.1:PORT -- PREFIX KEYS ROUNDS
-- Keys are PREFIX-GENERATION-SLOT, SLOT in 0 … KEYS-1. Each wrk thread counts its own requests;
-- the threads run at about the same rate, so they send the same generation at about the same
-- time (a thread that runs ahead only makes its keys new a little earlier).

local common = dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "wrk_common.lua")

local prefix = "hot"
local keys = 8
local rounds = 32
local sent = 0

function init(args)
   prefix = args[1] or prefix
   keys = tonumber(args[2]) or keys
   rounds = tonumber(args[3]) or rounds
end

function request()
   local slot = sent % keys
   local generation = math.floor(sent / (keys * rounds))
   sent = sent + 1
   return common.post(string.format("%s-%d-%d", prefix, generation, slot))
end

done = common.done
