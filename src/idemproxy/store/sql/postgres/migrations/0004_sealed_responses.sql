-- SPEC §11, encryption at rest: the id of the key ring's key a stored response is sealed with.
-- NULL: in the clear, as before. Set: `response_body` (`late_body`) holds the sealed box of the
-- headers and body, and `response_headers` (`late_headers`) is NULL.
ALTER TABLE idemproxy.jobs ADD COLUMN IF NOT EXISTS response_key text;
ALTER TABLE idemproxy.attempts ADD COLUMN IF NOT EXISTS late_key text;
