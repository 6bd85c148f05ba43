-- Shared by the benchmark's wrk scripts: the request and a done() that prints JSON.
--
-- Each script loads this file from its own folder:
--   local common = dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "wrk_common.lua")
-- bench/common.py passes BENCH_BODY so that the replay pre-warm (runner.py) sends the very same bytes
-- (the proxy fingerprints the body; a different body under a stored key is a 422, not a replay).

local common = {}

common.body = os.getenv("BENCH_BODY") or '{"amount":1250,"currency":"EUR","note":"bench"}'
common.path = os.getenv("BENCH_PATH") or "/orders"

-- A POST with the JSON body; `key` adds an Idempotency-Key header.
function common.post(key)
   local headers = { ["Content-Type"] = "application/json" }
   if key then
      headers["Idempotency-Key"] = key
   end
   return wrk.format("POST", common.path, headers, common.body)
end

-- One line for the harness to parse: "BENCH_RESULT {...}" (latencies in microseconds).
function common.done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      'BENCH_RESULT {"requests":%d,"duration_us":%d,"bytes":%d,'
         .. '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},'
         .. '"latency_us":{"mean":%.1f,"stdev":%.1f,"max":%d,'
         .. '"p50":%d,"p90":%d,"p99":%d,"p999":%d}}\n',
      summary.requests, summary.duration, summary.bytes,
      e.connect, e.read, e.write, e.status, e.timeout,
      latency.mean, latency.stdev, latency.max,
      latency:percentile(50), latency:percentile(90),
      latency:percentile(99), latency:percentile(99.9)))
end

return common
