-- SPEC §3.6: what the proxy asked about an `unknown` attempt and what it was answered. `checks`
-- counts the questions (a compare-and-swap on it lets one replica at a time ask), `checked_at`
-- is when the last one was asked by the database clock (the backoff counts from it), and
-- `evidence` keeps the latest questions and answers as a JSON array.
ALTER TABLE idemproxy.attempts ADD COLUMN IF NOT EXISTS checks integer NOT NULL DEFAULT 0;
ALTER TABLE idemproxy.attempts ADD COLUMN IF NOT EXISTS checked_at timestamptz;
ALTER TABLE idemproxy.attempts ADD COLUMN IF NOT EXISTS evidence jsonb;
