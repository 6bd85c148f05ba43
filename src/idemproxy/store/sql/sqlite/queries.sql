-- Named queries for the SQLite store. Each section starts with "-- name: <name>".
-- SQLite has no data-modifying CTEs, so multi-row changes run in one IMMEDIATE transaction.
-- (julianday('now') - 2440587.5) * 86400.0 is the database clock in Unix seconds (SPEC §3.5).

-- name: insert_job
-- SPEC §2.2: the (owner, key) primary key decides which claim creates the job.
INSERT INTO jobs (owner, key, id, fingerprint, method, path, created_at, updated_at, expires_at,
                  lease_expires_at)
VALUES (:owner, :key, :id, :fingerprint, :method, :path,
        (julianday('now') - 2440587.5) * 86400.0,
        (julianday('now') - 2440587.5) * 86400.0,
        (julianday('now') - 2440587.5) * 86400.0 + :ttl,
        (julianday('now') - 2440587.5) * 86400.0 + :lease)
ON CONFLICT (owner, key) DO NOTHING;

-- name: insert_attempt
INSERT INTO attempts (owner, job_id, number, upstream, started_at, lease_expires_at)
VALUES (:owner, :job_id, :number, :upstream,
        (julianday('now') - 2440587.5) * 86400.0,
        (julianday('now') - 2440587.5) * 86400.0 + :lease);

-- name: quota_usage
-- SPEC §9: quotas, in the claim's transaction (BEGIN IMMEDIATE: one writer at a time). As the
-- PostgreSQL query: live leases in flight, jobs of the last second, stored bytes when asked.
-- The jobs in flight are read from the owner's entries of their own index (migration 0007).
SELECT EXISTS (SELECT 1 FROM jobs WHERE owner = :owner AND key = :key) AS taken,
       (SELECT count(*) FROM jobs
        WHERE owner = :owner AND state = 'in_flight'
          AND lease_expires_at > (julianday('now') - 2440587.5) * 86400.0) AS in_flight,
       (SELECT count(*) FROM jobs
        WHERE owner = :owner AND id >= :since
          AND created_at > (julianday('now') - 2440587.5) * 86400.0 - 1.0) AS recent,
       CASE WHEN :bytes THEN (SELECT coalesce(sum(length(response_body)), 0)
                              FROM jobs WHERE owner = :owner AND state = 'completed')
                           + (SELECT coalesce(sum(length(late_body)), 0)
                              FROM attempts WHERE owner = :owner AND late_body IS NOT NULL)
            ELSE 0 END AS stored_bytes,
       CASE WHEN :bytes THEN (SELECT count(*) FROM jobs
                              WHERE owner = :owner AND state = 'in_flight')
            ELSE 0 END AS pending;

-- name: get_job
SELECT *, expires_at <= (julianday('now') - 2440587.5) * 86400.0 AS expired,
       state = 'in_flight' AND lease_expires_at <= (julianday('now') - 2440587.5) * 86400.0
           AS lease_expired
FROM jobs
WHERE owner = :owner AND key = :key;

-- name: get_job_by_id
SELECT *, expires_at <= (julianday('now') - 2440587.5) * 86400.0 AS expired,
       state = 'in_flight' AND lease_expires_at <= (julianday('now') - 2440587.5) * 86400.0
           AS lease_expired
FROM jobs
WHERE id = :id;

-- name: get_attempts
SELECT number, upstream, state, status, error, started_at, finished_at,
       length(late_body) AS late_bytes, checks, checked_at, evidence, sent_digest
FROM attempts
WHERE owner = :owner AND job_id = :job_id
ORDER BY number;

-- name: get_late_response
SELECT status, late_headers, late_body, late_key
FROM attempts
WHERE owner = :owner AND job_id = :job_id AND number = :number AND late_body IS NOT NULL;

-- name: complete_job
-- The seed's compare-and-swap: exactly one attempt's result wins.
UPDATE jobs
SET state = 'completed', version = version + 1, completed_by = :attempt,
    response_status = :status, response_headers = :headers, response_body = :body,
    response_omitted = :omitted, response_key = :key_id, lease_expires_at = NULL,
    updated_at = (julianday('now') - 2440587.5) * 86400.0,
    expires_at = (julianday('now') - 2440587.5) * 86400.0 + :ttl
WHERE owner = :owner AND id = :id AND version = :version AND completed_by IS NULL
  AND state = 'in_flight';

-- name: finish_attempt
UPDATE attempts
SET state = :state, status = :status, error = :error,
    finished_at = (julianday('now') - 2440587.5) * 86400.0, lease_expires_at = NULL
WHERE owner = :owner AND job_id = :job_id AND number = :attempt AND state = 'started';

-- name: succeed_attempt
-- The attempt whose result won the completion (see the PostgreSQL query `complete`).
UPDATE attempts
SET state = 'succeeded', status = :status,
    finished_at = (julianday('now') - 2440587.5) * 86400.0, lease_expires_at = NULL
WHERE owner = :owner AND job_id = :job_id AND number = :attempt
  AND state IN ('started', 'unknown');

-- name: discard_attempt
-- A late result (the job completed or was taken over meanwhile): recorded, never replayed.
-- Taken over (the job is `unknown`): its response is kept for the operator, within
-- :kept_limit bytes of kept bodies per job in all (see the PostgreSQL query `complete`).
UPDATE attempts
SET state = 'discarded', status = :status,
    finished_at = (julianday('now') - 2440587.5) * 86400.0, lease_expires_at = NULL,
    late_headers = CASE WHEN :keep THEN :headers END,
    late_body = CASE WHEN :keep THEN :body END,
    late_key = CASE WHEN :keep THEN :key_id END
WHERE owner = :owner AND job_id = :job_id AND number = :attempt
  AND state IN ('started', 'unknown');

-- name: may_keep_late
-- Whether a late response of :body_bytes may be kept on an attempt of this job (SQLite has
-- no data-modifying CTEs; this runs in the completion's own transaction).
SELECT EXISTS (SELECT 1 FROM jobs WHERE owner = :owner AND id = :job_id AND state = 'unknown')
       AND (SELECT coalesce(sum(length(late_body)), 0) FROM attempts
            WHERE owner = :owner AND job_id = :job_id) + :body_bytes <= :kept_limit AS keep;

-- name: settle_job
UPDATE jobs
SET state = :state, version = version + 1, lease_expires_at = NULL,
    updated_at = (julianday('now') - 2440587.5) * 86400.0
WHERE owner = :owner AND id = :id AND version = :version AND state = 'in_flight';

-- name: reopen_job
-- SPEC §2.3: exactly one retry of a released job wins this CAS.
UPDATE jobs
SET state = 'in_flight', version = version + 1, attempt_count = attempt_count + 1,
    lease_expires_at = (julianday('now') - 2440587.5) * 86400.0 + :lease,
    updated_at = (julianday('now') - 2440587.5) * 86400.0, started_by = :started_by
WHERE owner = :owner AND id = :id AND version = :version AND state = 'released';

-- name: advance_job
-- SPEC §3.4: fail over to the next upstream without leaving in_flight.
UPDATE jobs
SET version = version + 1, attempt_count = attempt_count + 1,
    lease_expires_at = (julianday('now') - 2440587.5) * 86400.0 + :lease,
    updated_at = (julianday('now') - 2440587.5) * 86400.0, started_by = :started_by
WHERE owner = :owner AND id = :id AND version = :version AND state = 'in_flight';

-- name: count_attempt
UPDATE jobs
SET attempt_count = attempt_count + 1,
    lease_expires_at = (julianday('now') - 2440587.5) * 86400.0 + :lease,
    updated_at = (julianday('now') - 2440587.5) * 86400.0
WHERE owner = :owner AND id = :id AND version = :version AND state = 'in_flight';

-- name: renew_job_lease
-- SPEC §3.5: the proxy running an attempt keeps its lease alive.
UPDATE jobs
SET lease_expires_at = (julianday('now') - 2440587.5) * 86400.0 + :lease
WHERE owner = :owner AND id = :id AND version = :version AND state = 'in_flight';

-- name: renew_attempt_leases
UPDATE attempts
SET lease_expires_at = (julianday('now') - 2440587.5) * 86400.0 + :lease
WHERE owner = :owner AND job_id = :id AND state = 'started';

-- name: take_over_job
-- SPEC §3.5: the lease expired by the database clock; exactly one takeover wins.
UPDATE jobs
SET state = 'unknown', version = version + 1, lease_expires_at = NULL,
    updated_at = (julianday('now') - 2440587.5) * 86400.0
WHERE owner = :owner AND id = :id AND version = :version AND state = 'in_flight'
  AND lease_expires_at <= (julianday('now') - 2440587.5) * 86400.0;

-- name: lose_attempts
UPDATE attempts
SET state = 'unknown', error = 'lease expired', lease_expires_at = NULL,
    finished_at = (julianday('now') - 2440587.5) * 86400.0
WHERE owner = :owner AND job_id = :id AND state = 'started';

-- name: expired_leases
-- SPEC §3.5: jobs in flight whose lease ran out at least :grace seconds ago, for the
-- background takeover (proxy/background/orphans.py).
SELECT *, expires_at <= (julianday('now') - 2440587.5) * 86400.0 AS expired,
       1 AS lease_expired
FROM jobs
WHERE state = 'in_flight'
  AND lease_expires_at <= (julianday('now') - 2440587.5) * 86400.0 - :grace
ORDER BY lease_expires_at
LIMIT :limit;

-- name: resolve_completed
-- SPEC §3.3: an operator settles an `unknown` job with the response it really had.
UPDATE jobs
SET state = 'completed', version = version + 1, completed_by = 0, resolution = :resolution,
    response_status = :status, response_headers = :headers, response_body = :body,
    response_omitted = 0, response_key = :key_id,
    updated_at = (julianday('now') - 2440587.5) * 86400.0,
    expires_at = (julianday('now') - 2440587.5) * 86400.0 + :ttl
WHERE owner = :owner AND id = :id AND version = :version AND state = 'unknown';

-- name: resolve_released
UPDATE jobs
SET state = 'released', version = version + 1, resolution = :resolution,
    updated_at = (julianday('now') - 2440587.5) * 86400.0
WHERE owner = :owner AND id = :id AND version = :version AND state = 'unknown';

-- name: stale_unknown
SELECT *, expires_at <= (julianday('now') - 2440587.5) * 86400.0 AS expired,
       0 AS lease_expired
FROM jobs
WHERE state = 'unknown' AND updated_at <= (julianday('now') - 2440587.5) * 86400.0 - :age
ORDER BY updated_at
LIMIT :limit;

-- name: delete_job
-- A compare-and-swap on the version the operator read; a job in flight with a live lease (by
-- the database clock) only when forced (see the PostgreSQL query).
DELETE FROM jobs
WHERE owner = :owner AND id = :id AND version = :version
  AND (:force OR state <> 'in_flight'
       OR lease_expires_at <= (julianday('now') - 2440587.5) * 86400.0);

-- name: forget
DELETE FROM jobs
WHERE owner = :owner AND id = :id AND version = :version AND state IN ('completed', 'released')
  AND expires_at <= (julianday('now') - 2440587.5) * 86400.0;

-- name: sweep_expired
-- SPEC §11: small batches, terminal jobs only; in_flight and unknown jobs are never swept.
DELETE FROM jobs
WHERE rowid IN (
    SELECT rowid FROM jobs
    WHERE expires_at <= (julianday('now') - 2440587.5) * 86400.0
      AND state IN ('completed', 'released')
    ORDER BY expires_at
    LIMIT :limit
);

-- name: list_jobs
SELECT *, expires_at <= (julianday('now') - 2440587.5) * 86400.0 AS expired,
       state = 'in_flight' AND lease_expires_at <= (julianday('now') - 2440587.5) * 86400.0
           AS lease_expired
FROM jobs
WHERE (:state IS NULL OR state = :state) AND (:owner IS NULL OR owner = :owner)
ORDER BY created_at DESC
LIMIT :limit;

-- name: clock
-- The clock that stamps `created_at` (insert_job): an erasure's cut-off (SPEC §11).
SELECT (julianday('now') - 2440587.5) * 86400.0 AS now;

-- name: owner_jobs
-- Erasure (SPEC §11): one owner's jobs created before :before, in id order, a batch after the
-- cursor.
SELECT *, expires_at <= (julianday('now') - 2440587.5) * 86400.0 AS expired,
       state = 'in_flight' AND lease_expires_at <= (julianday('now') - 2440587.5) * 86400.0
           AS lease_expired
FROM jobs
WHERE owner = :owner AND id > :after AND created_at < :before
ORDER BY id
LIMIT :limit;

-- name: count_unknown
SELECT count(*) AS unknown FROM jobs WHERE state = 'unknown';

-- name: responses_to_reseal
-- SPEC §11, `idemproxy store reseal`: see the PostgreSQL query `responses_to_reseal`.
SELECT *, expires_at <= (julianday('now') - 2440587.5) * 86400.0 AS expired,
       0 AS lease_expired
FROM jobs
WHERE state = 'completed' AND response_key IS NOT :primary AND (owner, id) > (:owner, :id)
ORDER BY owner, id
LIMIT :limit;

-- name: reseal_response
UPDATE jobs
SET response_headers = NULL, response_body = :box, response_key = :key_id
WHERE owner = :owner AND id = :id AND version = :version AND state = 'completed'
  AND response_key IS :read_with;

-- name: late_responses_to_reseal
SELECT a.owner, a.job_id, a.number, a.status, a.late_headers, a.late_body, a.late_key, j.key
FROM attempts a
JOIN jobs j ON j.owner = a.owner AND j.id = a.job_id
WHERE a.late_body IS NOT NULL AND a.late_key IS NOT :primary
  AND (a.owner, a.job_id, a.number) > (:owner, :id, :number)
ORDER BY a.owner, a.job_id, a.number
LIMIT :limit;

-- name: reseal_late_response
UPDATE attempts
SET late_headers = NULL, late_body = :box, late_key = :key_id
WHERE owner = :owner AND job_id = :job_id AND number = :number AND late_body IS NOT NULL
  AND late_key IS :read_with;

-- name: due_unknown
-- SPEC §3.6: see the PostgreSQL query `due_unknown`.
SELECT j.*, j.expires_at <= (julianday('now') - 2440587.5) * 86400.0 AS expired,
       0 AS lease_expired
FROM jobs AS j
WHERE j.state = 'unknown' AND j.id > :after
  AND EXISTS (SELECT 1 FROM attempts AS a
              WHERE a.owner = j.owner AND a.job_id = j.id AND a.state IN ('unknown', 'discarded')
                AND coalesce(a.checked_at, a.finished_at, a.started_at)
                    <= (julianday('now') - 2440587.5) * 86400.0
                       - CASE WHEN a.checks = 0 THEN :first
                              ELSE :answer_within
                                   + min(:first * (1 << min(a.checks, 32)), :longest) END)
ORDER BY j.id
LIMIT :limit;

-- name: claim_check
-- SPEC §3.6: see the PostgreSQL query `claim_check`.
UPDATE attempts
SET checks = checks + 1, checked_at = (julianday('now') - 2440587.5) * 86400.0
WHERE owner = :owner AND job_id = :job_id AND number = :number AND checks = :checks
  AND coalesce(checked_at, finished_at, started_at)
      <= (julianday('now') - 2440587.5) * 86400.0 - :due_after
  AND EXISTS (SELECT 1 FROM jobs
              WHERE owner = :owner AND id = :job_id AND state = 'unknown'
                AND version = :version);

-- name: record_evidence
-- SPEC §3.6: see the PostgreSQL query `record_evidence`.
UPDATE attempts
SET evidence = (
    SELECT json_group_array(json(value))
    FROM (SELECT value, n
          FROM (SELECT value, key AS n
                FROM json_each(json_insert(coalesce(evidence, '[]'), '$[#]', json(:entry)))
                ORDER BY n DESC LIMIT :keep)
          ORDER BY n)
)
WHERE owner = :owner AND job_id = :job_id AND number = :number;

-- name: note_sent
-- SPEC §3.6: see the PostgreSQL query `note_sent`.
UPDATE attempts SET sent_digest = :digest
WHERE owner = :owner AND job_id = :job_id AND number = :number;

-- name: resend_job
-- SPEC §3.6: see the PostgreSQL query `resend_job`.
UPDATE jobs
SET state = 'in_flight', version = version + 1, attempt_count = attempt_count + 1,
    lease_expires_at = (julianday('now') - 2440587.5) * 86400.0 + :lease,
    updated_at = (julianday('now') - 2440587.5) * 86400.0, started_by = :started_by
WHERE owner = :owner AND id = :id AND version = :version AND state = 'unknown'
  AND EXISTS (SELECT 1 FROM attempts AS a
              WHERE a.owner = :owner AND a.job_id = :id AND a.number = :number
                AND a.started_at > (julianday('now') - 2440587.5) * 86400.0 - :window);

-- name: read_only
-- At open: a write that changes nothing, which a database SQLite could only open read-only (a
-- file the process may not write) refuses.
UPDATE jobs SET version = version WHERE 0;
