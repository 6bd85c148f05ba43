-- Named queries for the PostgreSQL store. Each section starts with "-- name: <name>".
-- Times always come from the database clock (SPEC §3.5), never from the proxy's.

-- name: claim
-- SPEC §2.2: create the job and its first attempt in one statement, relying on the (owner, key)
-- primary key. When the job exists and was committed before this statement began, the second
-- branch returns it in the same round trip; when a concurrent claim committed it while this one
-- waited on the unique index, no row comes back and the caller re-reads with `get_job`.
WITH new_job AS (
    INSERT INTO idemproxy.jobs (owner, key, id, fingerprint, method, path, expires_at)
    VALUES ($1, $2, $3, $4, $5, $6, now() + make_interval(secs => $7))
    ON CONFLICT (owner, key) DO NOTHING
    RETURNING *
), first_attempt AS (
    INSERT INTO idemproxy.attempts (owner, job_id, number, upstream, lease_expires_at)
    SELECT owner, id, 1, $8, now() + make_interval(secs => $9) FROM new_job
)
SELECT true AS created, id, owner, key, fingerprint, state, version, attempt_count, method, path,
       completed_by, response_status, response_headers, response_body, response_omitted,
       created_at, expires_at, false AS expired
FROM new_job
UNION ALL
SELECT false, id, owner, key, fingerprint, state, version, attempt_count, method, path,
       completed_by, response_status, response_headers, response_body, response_omitted,
       created_at, expires_at, expires_at <= now()
FROM idemproxy.jobs
WHERE owner = $1 AND key = $2 AND NOT EXISTS (SELECT 1 FROM new_job);

-- name: get_job
SELECT id, owner, key, fingerprint, state, version, attempt_count, method, path,
       completed_by, response_status, response_headers, response_body, response_omitted,
       created_at, expires_at, expires_at <= now() AS expired
FROM idemproxy.jobs
WHERE owner = $1 AND key = $2;

-- name: get_job_by_id
SELECT id, owner, key, fingerprint, state, version, attempt_count, method, path,
       completed_by, response_status, response_headers, response_body, response_omitted,
       created_at, expires_at, expires_at <= now() AS expired
FROM idemproxy.jobs
WHERE id = $1;

-- name: get_attempts
SELECT number, upstream, state, status, error, started_at, finished_at
FROM idemproxy.attempts
WHERE job_id = $1
ORDER BY number;

-- name: complete
-- The seed's compare-and-swap: exactly one attempt's result wins. A losing attempt is marked
-- `discarded`; its response is never written.
WITH won AS (
    UPDATE idemproxy.jobs
    SET state = 'completed', version = version + 1, completed_by = $3,
        response_status = $4, response_headers = $5, response_body = $6, response_omitted = $7,
        updated_at = now(), expires_at = now() + make_interval(secs => $8)
    WHERE id = $1 AND version = $2 AND completed_by IS NULL AND state = 'in_flight'
    RETURNING owner, id
), attempt AS (
    UPDATE idemproxy.attempts
    SET state = CASE WHEN EXISTS (SELECT 1 FROM won) THEN 'succeeded' ELSE 'discarded' END,
        status = $4, finished_at = now(), lease_expires_at = NULL
    WHERE job_id = $1 AND number = $3 AND state = 'started'
)
SELECT pg_notify('idemproxy_jobs', id::text) FROM won;

-- name: settle
-- Release (nothing executed) or mark unknown (may have executed): $4 is the new job state and
-- $5 the attempt's. Only the attempt that holds the current version may settle the job.
WITH settled AS (
    UPDATE idemproxy.jobs
    SET state = $4, version = version + 1, updated_at = now()
    WHERE id = $1 AND version = $2 AND state = 'in_flight'
    RETURNING owner, id
), attempt AS (
    UPDATE idemproxy.attempts
    SET state = $5, status = $6, error = $7, finished_at = now(), lease_expires_at = NULL
    WHERE job_id = $1 AND number = $3 AND state = 'started'
)
SELECT pg_notify('idemproxy_jobs', id::text) FROM settled;

-- name: start_next_attempt
-- SPEC §2.3: of all the retries of a released job exactly one wins this CAS and runs the next
-- attempt under the same job.
WITH job AS (
    UPDATE idemproxy.jobs
    SET state = 'in_flight', version = version + 1, attempt_count = attempt_count + 1,
        updated_at = now()
    WHERE id = $1 AND version = $2 AND state = 'released'
    RETURNING *
), next_attempt AS (
    INSERT INTO idemproxy.attempts (owner, job_id, number, upstream, lease_expires_at)
    SELECT owner, id, attempt_count, $3, now() + make_interval(secs => $4) FROM job
)
SELECT id, owner, key, fingerprint, state, version, attempt_count, method, path,
       completed_by, response_status, response_headers, response_body, response_omitted,
       created_at, expires_at, false AS expired
FROM job;

-- name: add_attempt
-- A further attempt under a job in flight (hedging, SPEC §3.4). The job's version is unchanged,
-- so every attempt started under it races for the same completion CAS.
WITH job AS (
    UPDATE idemproxy.jobs
    SET attempt_count = attempt_count + 1, updated_at = now()
    WHERE id = $1 AND version = $2 AND state = 'in_flight'
    RETURNING owner, id, attempt_count
)
INSERT INTO idemproxy.attempts (owner, job_id, number, upstream, lease_expires_at)
SELECT owner, id, attempt_count, $3, now() + make_interval(secs => $4) FROM job
RETURNING number;

-- name: forget
-- Deletes one expired terminal job so that its key can be claimed afresh (SPEC §11).
DELETE FROM idemproxy.jobs
WHERE id = $1 AND version = $2 AND state IN ('completed', 'released') AND expires_at <= now();

-- name: sweep_expired
-- SPEC §11: small batches, terminal jobs only; in_flight and unknown jobs are never swept.
DELETE FROM idemproxy.jobs
WHERE (owner, id) IN (
    SELECT owner, id FROM idemproxy.jobs
    WHERE expires_at <= now() AND state IN ('completed', 'released')
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
);

-- name: list_jobs
SELECT id, owner, key, fingerprint, state, version, attempt_count, method, path,
       completed_by, response_status, response_headers, response_body, response_omitted,
       created_at, expires_at, expires_at <= now() AS expired
FROM idemproxy.jobs
WHERE ($1::text IS NULL OR state = $1) AND ($2::text IS NULL OR owner = $2)
ORDER BY created_at DESC
LIMIT $3;

-- name: ping
SELECT 1;
