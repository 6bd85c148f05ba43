-- SPEC §3.3: a late response (its completion lost the CAS because the job had been taken over
-- as `unknown`) is kept on its attempt, so that an operator can resolve the job with the
-- response it really had (`jobs resolve --from-attempt N`). Bounded per job in all by the
-- proxy's `max_stored_body` (queries.sql `complete`).
ALTER TABLE idemproxy.attempts ADD COLUMN IF NOT EXISTS late_headers jsonb;
ALTER TABLE idemproxy.attempts ADD COLUMN IF NOT EXISTS late_body bytea;
