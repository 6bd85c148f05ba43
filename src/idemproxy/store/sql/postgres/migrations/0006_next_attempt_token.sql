-- SPEC §3.4: the token of the statement that started the job's current attempt
-- (`start_next_attempt`, `fail_over`). When that statement's answer is lost, the process that
-- sent it reads the job back: only with its own token is the attempt in flight the one it never
-- forwarded, which it may release (proxy/background/unsent.py); another retry's is left alone.
ALTER TABLE idemproxy.jobs ADD COLUMN IF NOT EXISTS started_by uuid;
