-- SPEC §3.5: the background takeover of jobs whose lease ran out (see the PostgreSQL migration).
CREATE INDEX IF NOT EXISTS jobs_lease_idx ON jobs (lease_expires_at) WHERE state = 'in_flight';
