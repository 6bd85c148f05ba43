-- SPEC §3.4: the token of the statement that started the job's current attempt
-- (`reopen_job`, `advance_job`): see the PostgreSQL migration 0006.
ALTER TABLE jobs ADD COLUMN started_by TEXT;
