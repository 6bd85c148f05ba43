-- SPEC §3.5: every proxy looks, in the background, for jobs whose lease ran out (their proxy
-- died) and takes them over as `unknown` (proxy/background/orphans.py, queries.sql `expired_leases`).
-- Partial: only jobs in flight, a small and short-lived set, are in it; a claim adds one entry.
CREATE INDEX IF NOT EXISTS jobs_lease_idx ON idemproxy.jobs (lease_expires_at)
    WHERE state = 'in_flight';
