-- SPEC §3.6: what the proxy asked about an `unknown` attempt and what it was answered. `checks`
-- counts the questions (a compare-and-swap on it lets one replica at a time ask), `checked_at`
-- is when the last one was asked by the database clock (the backoff counts from it), and
-- `evidence` keeps the latest questions and answers as a JSON array.
ALTER TABLE idemproxy.attempts ADD COLUMN IF NOT EXISTS checks integer NOT NULL DEFAULT 0;
ALTER TABLE idemproxy.attempts ADD COLUMN IF NOT EXISTS checked_at timestamptz;
ALTER TABLE idemproxy.attempts ADD COLUMN IF NOT EXISTS evidence jsonb;
-- SPEC §3.6: on a route whose upstream honours the key, the digest of the request as this
-- attempt sent it (method, target, body): a retry of an `unknown` job goes upstream again under
-- the key only when it would send the very same bytes.
ALTER TABLE idemproxy.attempts ADD COLUMN IF NOT EXISTS sent_digest text;
