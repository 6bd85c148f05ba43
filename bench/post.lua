-- POST with a JSON body and no Idempotency-Key: the backend direct, or the proxy's pass-through.
-- Usage: wrk -t1 -c1 -d5s -s bench/post.lua http://127.0.0.1:PORT

local common = dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "wrk_common.lua")

wrk.method = "POST"
wrk.path = common.path
wrk.body = common.body
wrk.headers["Content-Type"] = "application/json"

done = common.done
