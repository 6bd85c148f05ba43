-- Named queries for the PostgreSQL store. Each section starts with "-- name: <name>".
-- Times always come from the database clock (SPEC §3.5), never from the proxy's.
-- Every hot-path statement names `owner` in its WHERE clause or conflict target, so that the
-- tables can be distributed by owner (Citus) and each statement is routed to one shard (§11);
-- rows inserted from a CTE take the owner from the parameter, not the CTE, for the same reason.
-- Every hot statement is a point lookup on the one index its equality columns match, whatever
-- the planner's statistics (migration 0005): by key `(key, owner)`, by id `(id, owner)`, attempts
-- `(job_id, number, owner)`. A batch restricts each table by the arrays of its keys or ids, never
-- by a join alone. The `(owner, id)` index only serves the statements that scan a range of one
-- owner's ids and name its predicate, `id >= '00000000-0000-0000-0000-000000000000'::uuid` (always true).

-- name: claim
-- SPEC §2.2: create the job and its first attempt in one statement, relying on the (owner, key)
-- primary key. A job committed before this statement began is read first and returned in the
-- same round trip, and then no insert is even attempted: a duplicate (every replay) costs a
-- point read, not a speculative insert that locks both tables (measured: a third less database
-- CPU). When a concurrent claim committed the job while this one waited on the unique index,
-- no row comes back and the caller re-reads with `get_job`.
WITH existing AS (
    SELECT * FROM idemproxy.jobs WHERE owner = $1 AND key = $2
), new_job AS (
    INSERT INTO idemproxy.jobs (owner, key, id, fingerprint, method, path, expires_at,
                                sweep_after, lease_expires_at)
    SELECT $1, $2, $3, $4, $5, $6, now() + make_interval(secs => $7),
           now() + make_interval(secs => $7), now() + make_interval(secs => $9)
    WHERE NOT EXISTS (SELECT 1 FROM existing)
    ON CONFLICT (owner, key) DO NOTHING
    RETURNING *
), first_attempt AS (
    INSERT INTO idemproxy.attempts (owner, job_id, number, upstream, lease_expires_at)
    SELECT $1, id, 1, $8, lease_expires_at FROM new_job
)
SELECT true AS created, *, false AS expired, false AS lease_expired
FROM new_job
UNION ALL
SELECT false, *, expires_at <= now(), state = 'in_flight' AND lease_expires_at <= now()
FROM existing;

-- name: claim_batch
-- Group commit (store/batching.py): the claims of one owner that queued while the previous
-- claim statement was in flight, as one statement and one durable commit. `claim`, row by row:
-- $2.. are arrays with one element per claim, one claim per key. The new jobs are inserted in
-- key order, so that two replicas' batches over overlapping keys wait for each other in the same
-- order and cannot deadlock. A key absent from the result was committed by a concurrent claim
-- while this one waited on the unique index: the caller claims it again alone.
WITH input AS (
    SELECT * FROM unnest($2::text[], $3::uuid[], $4::text[], $5::text[], $6::text[],
                         $7::float8[], $8::text[], $9::float8[])
        AS t(key, id, fingerprint, method, path, ttl, upstream, lease)
), existing AS (
    -- One point lookup per key. Not `key = ANY($2)`: a generic plan made on small tables took
    -- a scan of a whole index with `owner = $1` alone instead (tests/store/test_pg_point_lookups.py).
    -- The subquery's OFFSET keeps it from being flattened into a join the planner may turn
    -- around; each key is then an equality lookup, which only the primary key serves.
    SELECT job.* FROM unnest($2::text[]) AS wanted(key)
    CROSS JOIN LATERAL (
        SELECT * FROM idemproxy.jobs WHERE owner = $1 AND key = wanted.key OFFSET 0
    ) AS job
), new_job AS (
    INSERT INTO idemproxy.jobs (owner, key, id, fingerprint, method, path, expires_at,
                                sweep_after, lease_expires_at)
    SELECT $1, key, id, fingerprint, method, path, now() + make_interval(secs => ttl),
           now() + make_interval(secs => ttl), now() + make_interval(secs => lease)
    FROM input
    WHERE NOT EXISTS (SELECT 1 FROM existing WHERE existing.key = input.key)
    ORDER BY key
    ON CONFLICT (owner, key) DO NOTHING
    RETURNING *
), first_attempt AS (
    INSERT INTO idemproxy.attempts (owner, job_id, number, upstream, lease_expires_at)
    SELECT $1, new_job.id, 1, input.upstream, new_job.lease_expires_at
    FROM new_job JOIN input ON input.key = new_job.key
)
SELECT true AS created, *, false AS expired, false AS lease_expired
FROM new_job
UNION ALL
SELECT false, *, expires_at <= now(), state = 'in_flight' AND lease_expires_at <= now()
FROM existing;

-- name: lock_owner
-- SPEC §9: quotas. New jobs of one owner are claimed one at a time across every replica (the
-- lock ends with the transaction), so that each counts what the ones before it claimed. Within
-- a process they take turns before taking a connection (store/postgres/quota.py `OwnerTurns`):
-- at most one connection per owner and process waits here.
SELECT pg_advisory_xact_lock(hashtextextended($1, 7320417));

-- name: quota_usage
-- Under `lock_owner`, in the claim's transaction. In flight: live leases only (a dead
-- replica's jobs do not hold the owner back), found from the owner's attempts that hold a lease
-- (migration 0010: those of its jobs in flight; the range names that index's predicate), each
-- job counted once (a hedged job has several) and looked up by id (a lateral subquery, as in
-- `expired_leases`) on its lease as renewed. Recent: from the (owner, id) index, ids being
-- time-ordered ($3, core/quota.py), checked on created_at too (older ids are random). Stored
-- bytes only when that limit is set ($4): it reads every job of the owner (stored bodies, and
-- every job in flight, which may still store one: core/quota.py `committed_bytes`) and the late
-- responses kept on its attempts.
SELECT EXISTS (SELECT 1 FROM idemproxy.jobs WHERE owner = $1 AND key = $2) AS taken,
       (SELECT count(*)
        FROM (SELECT DISTINCT job_id FROM idemproxy.attempts
              WHERE owner = $1 AND lease_expires_at > '-infinity') AS leased
        CROSS JOIN LATERAL (
            SELECT 1 FROM idemproxy.jobs
            WHERE owner = $1 AND id = leased.job_id AND state = 'in_flight'
              AND lease_expires_at > now()
            OFFSET 0
        ) AS job) AS in_flight,
       (SELECT count(*) FROM idemproxy.jobs
        WHERE owner = $1 AND id >= '00000000-0000-0000-0000-000000000000'::uuid AND id >= $3::uuid
          AND created_at > now() - interval '1 second') AS recent,
       CASE WHEN $4 THEN (SELECT coalesce(sum(octet_length(response_body)), 0)
                          FROM idemproxy.jobs
                          WHERE owner = $1 AND id >= '00000000-0000-0000-0000-000000000000'::uuid
                            AND state = 'completed')
                       + (SELECT coalesce(sum(octet_length(late_body)), 0)
                          FROM idemproxy.attempts WHERE owner = $1 AND late_body IS NOT NULL)
            ELSE 0 END AS stored_bytes,
       CASE WHEN $4 THEN (SELECT count(*) FROM idemproxy.jobs
                          WHERE owner = $1 AND id >= '00000000-0000-0000-0000-000000000000'::uuid
                            AND state = 'in_flight')
            ELSE 0 END AS pending;

-- name: get_job
SELECT *, expires_at <= now() AS expired,
       state = 'in_flight' AND lease_expires_at <= now() AS lease_expired
FROM idemproxy.jobs
WHERE owner = $1 AND key = $2;

-- name: watch_job
-- A duplicate is about to wait (SPEC §2.3): from now on every state change of the job is
-- announced. A row comes back only when this statement marked a job that is still in flight;
-- otherwise the caller re-reads it (it may have changed while this statement waited).
-- `now()` is compared outside the UPDATE: Citus refuses functions that are not IMMUTABLE in
-- the RETURNING clause of a distributed UPDATE, and runs the CTE form on the one shard.
WITH marked AS (
    UPDATE idemproxy.jobs
    SET watched = true
    WHERE owner = $1 AND key = $2 AND state = 'in_flight' AND NOT watched
    RETURNING *
)
SELECT *, expires_at <= now() AS expired, lease_expires_at <= now() AS lease_expired
FROM marked;

-- name: get_job_by_id
-- Operators only know the id; not on the hot path.
SELECT *, expires_at <= now() AS expired,
       state = 'in_flight' AND lease_expires_at <= now() AS lease_expired
FROM idemproxy.jobs
WHERE id = $1;

-- name: get_attempts
SELECT number, upstream, state, status, error, started_at, finished_at,
       octet_length(late_body) AS late_bytes, checks, checked_at, evidence::text AS evidence,
       sent_digest
FROM idemproxy.attempts
WHERE owner = $1 AND job_id = $2
ORDER BY number;

-- name: get_late_response
-- SPEC §3.3: the response a late attempt really had, kept when its completion lost the CAS.
SELECT status, late_headers, late_body, late_key
FROM idemproxy.attempts
WHERE owner = $1 AND job_id = $2 AND number = $3 AND late_body IS NOT NULL;

-- name: complete
-- The seed's compare-and-swap: exactly one attempt's result wins. A losing attempt is marked
-- `discarded`; its response is never replayed. When it lost because the job had been taken
-- over as `unknown` (SPEC §3.5), the response is kept on the attempt for the operator who
-- resolves the job (SPEC §3.3), within $10 bytes of kept bodies per job in all; a hedging
-- loser's (the job completed) is not needed by anyone and is not kept. $11: the key a sealed
-- response is sealed with (SPEC §11; then $6 is NULL and $7 the box), NULL in the clear. $12: the
-- job's key, so that both indexes holding `owner` are looked up by their leading column. It
-- changes no column that an index of `jobs` names (`sweep_after` keeps its value unless a shorter
-- ttl makes the new expiry earlier), so the job is updated in place (HOT, migration 0007).
WITH won AS (
    UPDATE idemproxy.jobs
    SET state = 'completed', version = version + 1, completed_by = $4,
        response_status = $5, response_headers = $6, response_body = $7, response_omitted = $8,
        response_key = $11,
        lease_expires_at = NULL, updated_at = now(),
        expires_at = now() + make_interval(secs => $9),
        sweep_after = least(sweep_after, now() + make_interval(secs => $9))
    WHERE owner = $1 AND key = $12 AND id = $2 AND version = $3 AND completed_by IS NULL
      AND state = 'in_flight'
    RETURNING owner, id, watched, attempt_count
), keep AS (
    SELECT true AS late
    WHERE NOT EXISTS (SELECT 1 FROM won) AND $7::bytea IS NOT NULL AND NOT $8
      AND EXISTS (SELECT 1 FROM idemproxy.jobs
                  WHERE owner = $1 AND key = $12 AND id = $2 AND state = 'unknown')
      AND (SELECT coalesce(sum(octet_length(late_body)), 0) FROM idemproxy.attempts
           WHERE owner = $1 AND job_id = $2) + octet_length($7::bytea) <= $10
), attempt AS (
    UPDATE idemproxy.attempts
    SET state = CASE WHEN EXISTS (SELECT 1 FROM won) THEN 'succeeded' ELSE 'discarded' END,
        status = $5, finished_at = now(), lease_expires_at = NULL,
        late_headers = CASE WHEN EXISTS (SELECT 1 FROM keep) THEN $6::jsonb END,
        late_body = CASE WHEN EXISTS (SELECT 1 FROM keep) THEN $7::bytea END,
        late_key = CASE WHEN EXISTS (SELECT 1 FROM keep) THEN $11::text END
    WHERE owner = $1 AND job_id = $2 AND number = $4 AND state IN ('started', 'unknown')
), ended AS (
    -- The job ended: its other attempts leave the lease scan (migration 0009). Only a job with
    -- several attempts has any; a job with one looks nothing up (the id is NULL).
    UPDATE idemproxy.attempts
    SET lease_expires_at = NULL
    WHERE owner = $1 AND job_id = (SELECT id FROM won WHERE attempt_count > 1)
      AND lease_expires_at IS NOT NULL AND NOT (number = $4 AND state IN ('started', 'unknown'))
)
-- `watched` tells a store on Citus to announce the change from the coordinator (`notify`); `id`
-- tells a pipeline of completions (store/postgres/store.py `_complete_batch`) which of its won.
SELECT id, watched, CASE WHEN watched THEN pg_notify('idemproxy_jobs', id::text) END AS notified
FROM won;

-- name: complete_sole
-- `complete` for a job of one attempt that wins (every new key's): the same compare-and-swap,
-- which also requires that the job has that one attempt, and the same changes when it wins. Its
-- `keep` and `ended` can do nothing then, and PostgreSQL sets up their scans and their update for
-- every execution all the same: a third of what `complete` costs over an UPDATE of one row
-- (docs/benchmarks.md, "What one new key's statements take"). It changes nothing when it does not
-- win; the store then sends `complete` (store/postgres/store.py `_complete_alone`), so a losing
-- attempt's response is discarded or kept as there. $1-$9 as in `complete`; $10 and $11 are its
-- $11 and $12.
WITH won AS (
    UPDATE idemproxy.jobs
    SET state = 'completed', version = version + 1, completed_by = $4,
        response_status = $5, response_headers = $6, response_body = $7, response_omitted = $8,
        response_key = $10,
        lease_expires_at = NULL, updated_at = now(),
        expires_at = now() + make_interval(secs => $9),
        sweep_after = least(sweep_after, now() + make_interval(secs => $9))
    WHERE owner = $1 AND key = $11 AND id = $2 AND version = $3 AND completed_by IS NULL
      AND state = 'in_flight' AND attempt_count = 1
    RETURNING owner, id, watched
), attempt AS (
    UPDATE idemproxy.attempts
    SET state = 'succeeded', status = $5, finished_at = now(), lease_expires_at = NULL,
        late_headers = NULL, late_body = NULL, late_key = NULL
    WHERE owner = $1 AND job_id = $2 AND number = $4 AND state IN ('started', 'unknown')
      AND EXISTS (SELECT 1 FROM won)
)
SELECT watched, CASE WHEN watched THEN pg_notify('idemproxy_jobs', id::text) END AS notified
FROM won;

-- name: settle
-- Release (nothing executed) or mark unknown (may have executed): $5 is the new job state and
-- $6 the attempt's. Only an attempt holding the current version may settle the job. $9: its key
-- (as in `complete`). A release is HOT; an unknown job is never swept (migration 0007).
WITH settled AS (
    UPDATE idemproxy.jobs
    SET state = $5, version = version + 1, lease_expires_at = NULL, updated_at = now(),
        sweep_after = CASE WHEN $5::text <> 'unknown' THEN sweep_after END
    WHERE owner = $1 AND key = $9 AND id = $2 AND version = $3 AND state = 'in_flight'
    RETURNING owner, id, watched, attempt_count
), attempt AS (
    UPDATE idemproxy.attempts
    SET state = $6, status = $7, error = $8, finished_at = now(), lease_expires_at = NULL
    WHERE owner = $1 AND job_id = $2 AND number = $4 AND state = 'started'
), ended AS (
    -- As in `complete`: the job's other attempts leave the lease scan (migration 0009).
    UPDATE idemproxy.attempts
    SET lease_expires_at = NULL
    WHERE owner = $1 AND job_id = (SELECT id FROM settled WHERE attempt_count > 1)
      AND lease_expires_at IS NOT NULL AND NOT (number = $4 AND state = 'started')
)
SELECT watched, CASE WHEN watched THEN pg_notify('idemproxy_jobs', id::text) END AS notified
FROM settled;

-- name: finish_attempt
-- One attempt of several (hedging) ended without a result; the job is left to the others. The
-- attempt keeps the lease it started with until the job ends (migration 0009): should this be
-- the last one running and its proxy die before settling the job, the lease scan finds the job.
-- A job that ended already may not have cleared this attempt's lease (a hedge added while the
-- completion waited for the job's row is not in the completion's snapshot): then it is cleared.
WITH job AS (
    SELECT state = 'in_flight' AS in_flight FROM idemproxy.jobs WHERE owner = $1 AND id = $2
)
UPDATE idemproxy.attempts
SET state = $4, status = $5, error = $6, finished_at = now(),
    lease_expires_at = CASE WHEN (SELECT in_flight FROM job) THEN lease_expires_at END
WHERE owner = $1 AND job_id = $2 AND number = $3 AND state = 'started';

-- name: start_next_attempt
-- SPEC §2.3: of all the retries of a released job exactly one wins this CAS and runs the next
-- attempt under the same job. $6: the caller's token (`started_by`, migration 0006).
WITH job AS (
    UPDATE idemproxy.jobs
    SET state = 'in_flight', version = version + 1, attempt_count = attempt_count + 1,
        lease_expires_at = now() + make_interval(secs => $5), updated_at = now(),
        started_by = $6
    WHERE owner = $1 AND id = $2 AND version = $3 AND state = 'released'
    RETURNING *
), next_attempt AS (
    INSERT INTO idemproxy.attempts (owner, job_id, number, upstream, lease_expires_at)
    SELECT $1, id, attempt_count, $4, lease_expires_at FROM job
)
SELECT *, expires_at <= now() AS expired, false AS lease_expired FROM job;

-- name: fail_over
-- SPEC §3.4: attempt $4 failed in a way that proves nothing executed; the next upstream gets
-- attempt $4 + 1 under the same job, in one transaction, so no other request can slip in.
-- $9: the caller's token, as in `start_next_attempt`.
WITH job AS (
    UPDATE idemproxy.jobs
    SET version = version + 1, attempt_count = attempt_count + 1,
        lease_expires_at = now() + make_interval(secs => $8), updated_at = now(),
        started_by = $9
    WHERE owner = $1 AND id = $2 AND version = $3 AND state = 'in_flight'
    RETURNING *
), failed AS (
    UPDATE idemproxy.attempts
    SET state = 'failed', status = $5, error = $6, finished_at = now(), lease_expires_at = NULL
    WHERE owner = $1 AND job_id = $2 AND number = $4 AND state = 'started'
      AND EXISTS (SELECT 1 FROM job)
), next_attempt AS (
    INSERT INTO idemproxy.attempts (owner, job_id, number, upstream, lease_expires_at)
    SELECT $1, id, attempt_count, $7, lease_expires_at FROM job
)
SELECT *, expires_at <= now() AS expired, false AS lease_expired FROM job;

-- name: add_attempt
-- A further attempt under a job in flight (hedging, SPEC §3.4). The job's version is unchanged,
-- so every attempt started under it races for the same completion CAS.
WITH job AS (
    UPDATE idemproxy.jobs
    SET attempt_count = attempt_count + 1,
        lease_expires_at = now() + make_interval(secs => $5), updated_at = now()
    WHERE owner = $1 AND id = $2 AND version = $3 AND state = 'in_flight'
    RETURNING owner, id, attempt_count, lease_expires_at
)
INSERT INTO idemproxy.attempts (owner, job_id, number, upstream, lease_expires_at)
SELECT $1, id, attempt_count, $4, lease_expires_at FROM job
RETURNING number;

-- name: renew_lease
-- SPEC §3.5: the proxy running an attempt keeps its lease alive while the upstream call runs.
-- $5: the job's key (as in `complete`). The job's lease alone, which no index names: an update in
-- place (HOT). Its attempts keep the lease they started with, by which `expired_leases` finds
-- them (migration 0007). Renewed when the job is still ours, whether or not an attempt row is
-- still `started`.
UPDATE idemproxy.jobs
SET lease_expires_at = now() + make_interval(secs => $4)
WHERE owner = $1 AND key = $5 AND id = $2 AND version = $3 AND state = 'in_flight'
RETURNING id;

-- name: take_over
-- SPEC §3.5: the proxy running the job died (its lease expired by the database clock). Exactly
-- one of the requests that notice wins this CAS and marks the job and its attempts `unknown`.
WITH job AS (
    UPDATE idemproxy.jobs
    SET state = 'unknown', version = version + 1, lease_expires_at = NULL, updated_at = now(),
        sweep_after = NULL
    WHERE owner = $1 AND id = $2 AND version = $3 AND state = 'in_flight'
      AND lease_expires_at <= now()
    RETURNING owner, id
), attempts AS (
    UPDATE idemproxy.attempts a
    SET state = 'unknown', error = 'lease expired', finished_at = now(), lease_expires_at = NULL
    FROM job
    WHERE a.owner = $1 AND a.job_id = $2 AND a.state = 'started'  -- parameters: as in renew_lease
), ended AS (
    -- The attempts that had ended keep their outcome and leave the lease scan (migration 0009).
    UPDATE idemproxy.attempts a
    SET lease_expires_at = NULL
    FROM job
    WHERE a.owner = $1 AND a.job_id = $2 AND a.state <> 'started' AND a.lease_expires_at IS NOT NULL
)
SELECT pg_notify('idemproxy_jobs', id::text) FROM job;

-- name: expired_leases
-- SPEC §3.5: jobs in flight whose lease ran out at least $1 seconds ago by the database clock
-- (their proxy died, or cannot reach the store), oldest first, for the background takeover
-- (proxy/background/orphans.py). Each is then taken over by the `take_over` CAS, as a request would.
-- Found from the attempts whose starting lease ran out as long ago (their index, migrations
-- 0007 and 0009): a job's lease is never earlier than the one its latest attempt started with,
-- which that attempt keeps, finished or not, until the job leaves `in_flight`. The range names
-- that index's predicate (`> '-infinity'`), without which no plan may take it. Then one point
-- lookup per job (a lateral subquery, as in `claim_batch`), on its lease as renewed.
SELECT job.*, job.expires_at <= now() AS expired, true AS lease_expired
FROM (
    SELECT DISTINCT owner, job_id FROM idemproxy.attempts
    WHERE lease_expires_at > '-infinity' AND lease_expires_at <= now() - make_interval(secs => $1)
) AS started
CROSS JOIN LATERAL (
    SELECT * FROM idemproxy.jobs
    WHERE id = started.job_id AND owner = started.owner AND state = 'in_flight'
      AND lease_expires_at <= now() - make_interval(secs => $1)
    OFFSET 0
) AS job
ORDER BY job.lease_expires_at
LIMIT $2;

-- name: resolve_completed
-- SPEC §3.3: an operator settles an `unknown` job with the response it really had ($9: the
-- key it is sealed with, SPEC §11, NULL in the clear).
WITH job AS (
    UPDATE idemproxy.jobs
    SET state = 'completed', version = version + 1, completed_by = 0, resolution = $4,
        response_status = $5, response_headers = $6, response_body = $7,
        response_omitted = false, response_key = $9, updated_at = now(),
        expires_at = now() + make_interval(secs => $8),
        sweep_after = now() + make_interval(secs => $8)
    WHERE owner = $1 AND id = $2 AND version = $3 AND state = 'unknown'
    RETURNING owner, id
)
SELECT pg_notify('idemproxy_jobs', id::text) FROM job;

-- name: resolve_released
-- SPEC §3.3: an operator (or unknown_ttl) states that nothing executed; a retry runs again.
WITH job AS (
    UPDATE idemproxy.jobs
    SET state = 'released', version = version + 1, resolution = $4, updated_at = now(),
        sweep_after = expires_at
    WHERE owner = $1 AND id = $2 AND version = $3 AND state = 'unknown'
    RETURNING owner, id
)
SELECT pg_notify('idemproxy_jobs', id::text) FROM job;

-- name: stale_unknown
-- SPEC §3.3: unknown jobs older than unknown_ttl, for the auto-release (off by default).
SELECT *, expires_at <= now() AS expired, false AS lease_expired
FROM idemproxy.jobs
WHERE sweep_after IS NULL AND state = 'unknown' AND updated_at <= now() - make_interval(secs => $1)
ORDER BY updated_at
LIMIT $2;

-- name: delete_job
-- An operator's delete (SPEC §3.3) is a compare-and-swap on the version they read ($3), and a
-- job in flight whose lease is live by the database clock is only deleted when forced ($4): its
-- attempt is running, and once the job is gone a retry would claim the key and run again. A
-- job read `released` that a retry restarted meanwhile has a new version, so it is not deleted.
WITH job AS (
    DELETE FROM idemproxy.jobs
    WHERE owner = $1 AND id = $2 AND version = $3
      AND ($4 OR state <> 'in_flight' OR lease_expires_at <= now())
    RETURNING owner, id
)
SELECT pg_notify('idemproxy_jobs', id::text) FROM job;

-- name: forget
-- Deletes one expired terminal job so that its key can be claimed afresh (SPEC §11).
DELETE FROM idemproxy.jobs
WHERE owner = $1 AND id = $2 AND version = $3 AND state IN ('completed', 'released')
  AND expires_at <= now();

-- name: sweep_expired
-- SPEC §11: small batches, terminal jobs only; in_flight and unknown jobs are never swept.
-- Read by `sweep_after`, a lower bound of the expiry, NULL for the unknown jobs (migration 0007):
-- the jobs it reads that are not expired yet are the ones completed since their claim's expiry
-- passed (or still in flight), few. Its range names both ends: what a planner without statistics
-- takes for a small part of the table, so that a generic plan made on an empty table reads the
-- index, not every job (tests/store/test_pg_point_lookups.py).
DELETE FROM idemproxy.jobs
WHERE (owner, id) IN (
    SELECT owner, id FROM idemproxy.jobs
    WHERE sweep_after > '-infinity' AND sweep_after <= now()
      AND expires_at <= now() AND state IN ('completed', 'released')
    ORDER BY sweep_after
    LIMIT $1
    FOR UPDATE SKIP LOCKED
);

-- name: sweep_expired_distributed
-- The sweep on Citus, which refuses `FOR UPDATE` in a query over several shards: the batch is
-- read from every shard first (a subplan), then deleted where it is still expired and terminal.
-- Two sweepers may pick the same rows; the second then deletes fewer, never a live job.
DELETE FROM idemproxy.jobs
WHERE expires_at <= now() AND state IN ('completed', 'released') AND (owner, id) IN (
    SELECT owner, id FROM idemproxy.jobs
    WHERE sweep_after > '-infinity' AND sweep_after <= now()
      AND expires_at <= now() AND state IN ('completed', 'released')
    ORDER BY sweep_after
    LIMIT $1
);

-- name: list_jobs
SELECT *, expires_at <= now() AS expired,
       state = 'in_flight' AND lease_expires_at <= now() AS lease_expired
FROM idemproxy.jobs
WHERE ($1::text IS NULL OR state = $1) AND ($2::text IS NULL OR owner = $2)
ORDER BY created_at DESC
LIMIT $3;

-- name: clock
-- The clock that stamps `created_at` (the claim's `now()`): an erasure's cut-off (SPEC §11). On
-- Citus, the coordinator's, as it evaluates `now()` for the statements it routes.
SELECT now() AS now;

-- name: owner_jobs
-- Erasure (SPEC §11): one owner's jobs created before $3, in id order, a batch after the cursor
-- $2; the `(owner, id)` index serves it (its predicate named).
SELECT *, expires_at <= now() AS expired,
       state = 'in_flight' AND lease_expires_at <= now() AS lease_expired
FROM idemproxy.jobs
WHERE owner = $1 AND id >= '00000000-0000-0000-0000-000000000000'::uuid AND id > $2::uuid
  AND created_at < $3
ORDER BY id
LIMIT $4;

-- name: count_unknown
-- From the index of the unknown jobs, the ones without a `sweep_after` (migration 0007).
SELECT count(*) AS unknown FROM idemproxy.jobs WHERE sweep_after IS NULL AND state = 'unknown';

-- name: ping
-- /readyz: whether the server takes writes. A hot standby (a failover that left the DSN on the
-- old primary, or a DSN naming a replica) and `default_transaction_read_only` answer reads
-- and refuse every claim.
SELECT NOT (pg_is_in_recovery() OR current_setting('transaction_read_only')::boolean)
    AS writable;

-- name: responses_to_reseal
-- SPEC §11, `idemproxy store reseal`: completed jobs whose response is not sealed with the
-- primary key $1 (in the clear, or under an older key), after ($2, $3) in (owner, id) order,
-- $4 at most: one bounded batch, resumed after its last row.
SELECT *, expires_at <= now() AS expired, false AS lease_expired
FROM idemproxy.jobs
WHERE state = 'completed' AND response_key IS DISTINCT FROM $1 AND (owner, id) > ($2, $3)
  AND id >= '00000000-0000-0000-0000-000000000000'::uuid
ORDER BY owner, id
LIMIT $4;

-- name: reseal_response
-- One response resealed: a compare-and-swap on the version and the key it was read with ($4),
-- so that a concurrent reseal, deletion or expiry wins and nothing else of the job changes.
-- Announced on the change feed: the in-process replay caches drop the old box.
WITH job AS (
    UPDATE idemproxy.jobs
    SET response_headers = NULL, response_body = $5, response_key = $6
    WHERE owner = $1 AND id = $2 AND version = $3 AND state = 'completed'
      AND response_key IS NOT DISTINCT FROM $4
    RETURNING owner, id
)
SELECT pg_notify('idemproxy_jobs', id::text) FROM job;

-- name: late_responses_to_reseal
-- The late responses kept on attempts (SPEC §3.3) not sealed with $1, after ($2, $3, $4) in
-- (owner, job id, number) order, $5 at most, with their job's key (bound in the seal).
SELECT a.owner, a.job_id, a.number, a.status, a.late_headers, a.late_body, a.late_key, j.key
FROM idemproxy.attempts a
JOIN idemproxy.jobs j ON j.owner = a.owner AND j.id = a.job_id
WHERE a.late_body IS NOT NULL AND a.late_key IS DISTINCT FROM $1
  AND (a.owner, a.job_id, a.number) > ($2, $3, $4)
ORDER BY a.owner, a.job_id, a.number
LIMIT $5;

-- name: reseal_late_response
UPDATE idemproxy.attempts
SET late_headers = NULL, late_body = $5, late_key = $6
WHERE owner = $1 AND job_id = $2 AND number = $3 AND late_body IS NOT NULL
  AND late_key IS NOT DISTINCT FROM $4;

-- The statements below are the Citus forms of `claim`, `start_next_attempt`, `fail_over` and
-- `add_attempt`. Citus plans an `INSERT … SELECT … FROM <cte>` in steps through the coordinator
-- (the CTE's rows become an intermediate result), not as a router query, so on Citus the store
-- runs the job's change and the attempt's insert as two router statements in one transaction
-- on the one shard (store/postgres/citus.py). Each mirrors its single-statement form above.

-- name: claim_job_distributed
-- `claim` without its reads: the caller read the job first (`get_job`) and found none.
INSERT INTO idemproxy.jobs (owner, key, id, fingerprint, method, path, expires_at,
                            sweep_after, lease_expires_at)
VALUES ($1, $2, $3, $4, $5, $6, now() + make_interval(secs => $7), now() + make_interval(secs => $7),
        now() + make_interval(secs => $8))
ON CONFLICT (owner, key) DO NOTHING
RETURNING *, false AS expired, false AS lease_expired;

-- name: start_next_attempt_distributed
WITH job AS (
    UPDATE idemproxy.jobs
    SET state = 'in_flight', version = version + 1, attempt_count = attempt_count + 1,
        lease_expires_at = now() + make_interval(secs => $4), updated_at = now(),
        started_by = $5
    WHERE owner = $1 AND id = $2 AND version = $3 AND state = 'released'
    RETURNING *
)
SELECT *, expires_at <= now() AS expired, false AS lease_expired FROM job;

-- name: fail_over_distributed
-- The attempt that failed is then ended by `finish_attempt`, the next one added by `add_attempt_row`.
WITH job AS (
    UPDATE idemproxy.jobs
    SET version = version + 1, attempt_count = attempt_count + 1,
        lease_expires_at = now() + make_interval(secs => $4), updated_at = now(),
        started_by = $5
    WHERE owner = $1 AND id = $2 AND version = $3 AND state = 'in_flight'
    RETURNING *
)
SELECT *, expires_at <= now() AS expired, false AS lease_expired FROM job;

-- name: add_attempt_distributed
UPDATE idemproxy.jobs
SET attempt_count = attempt_count + 1,
    lease_expires_at = now() + make_interval(secs => $4), updated_at = now()
WHERE owner = $1 AND id = $2 AND version = $3 AND state = 'in_flight'
RETURNING id, attempt_count, lease_expires_at;

-- name: add_attempt_row
INSERT INTO idemproxy.attempts (owner, job_id, number, upstream, lease_expires_at)
VALUES ($1, $2, $3, $4, $5);

-- name: citus_version
-- The Citus extension's version in this database, or no row on a plain PostgreSQL. The store
-- reads it once at start-up to pick the statements and wake-ups a distributed store needs.
SELECT extversion FROM pg_extension WHERE extname = 'citus';

-- name: notify
-- A job change announced from the node the proxies LISTEN on. On Citus a statement routed to a
-- worker raises its `pg_notify` there, where nobody listens; the store then sends this on the
-- coordinator once the statement has committed (SPEC §11 change feed).
SELECT pg_notify('idemproxy_jobs', $1);

-- name: distributed_tables
-- How `jobs` and `attempts` are distributed (`idemproxy migrate --distribute`): one row per
-- table Citus knows, with its distribution column and co-location group.
SELECT table_name::text AS table_name, citus_table_type, distribution_column, colocation_id
FROM citus_tables
WHERE table_name IN ('idemproxy.jobs'::regclass, 'idemproxy.attempts'::regclass);

-- name: distribute_jobs
SELECT create_distributed_table('idemproxy.jobs', 'owner');

-- name: distribute_attempts
SELECT create_distributed_table('idemproxy.attempts', 'owner', colocate_with => 'idemproxy.jobs');

-- name: local_copy_bytes
-- The bytes a distributed table still holds in the coordinator's own relation (its heap and
-- TOAST): the rows it had before `create_distributed_table` copied them into the shards.
SELECT pg_relation_size(c.oid) + coalesce(pg_relation_size(nullif(c.reltoastrelid, 0)), 0)
FROM pg_class c WHERE c.oid = $1::text::regclass;

-- name: drop_local_copy
SELECT truncate_local_data_after_distributing_table($1::text::regclass);

-- name: due_unknown
-- SPEC §3.6: the `unknown` jobs of which an attempt asked about (`unknown`, or `discarded`: it
-- answered after the job became unknown; core/resolution.py `asked_attempts`) is due a question by the database clock, under the
-- backoff $1 (the first wait), $2 (the longest wait) and $3 (the time an answer may take) as
-- core/resolution.py `Backoff.due_after` counts it: those with ids above $4, in id order, $5 at
-- most, one page of a pass that reads them all. From the index of the unknown jobs (their
-- `sweep_after` is NULL, migration 0007), and each attempt by its key; `claim_check` decides
-- for each by its own route's backoff.
SELECT j.*, j.expires_at <= now() AS expired, false AS lease_expired
FROM idemproxy.jobs AS j
WHERE j.sweep_after IS NULL AND j.state = 'unknown' AND j.id > $4
  AND EXISTS (
      SELECT 1 FROM idemproxy.attempts AS a
      WHERE a.owner = j.owner AND a.job_id = j.id AND a.state IN ('unknown', 'discarded')
        AND coalesce(a.checked_at, a.finished_at, a.started_at) <= now() - make_interval(secs =>
            CASE WHEN a.checks = 0 THEN $1::float8
                 ELSE $3::float8 + least($1::float8 * (1::bigint << least(a.checks, 32)), $2::float8)
            END))
ORDER BY j.id
LIMIT $5;

-- name: claim_check
-- SPEC §3.6: the right to ask about attempt $3 of an `unknown` job at version $4 once more. A
-- compare-and-swap on `checks` ($5, as read): of the replicas that find it due at once, one
-- asks. Due once $6 seconds passed, by the database clock, since the last question, or since
-- the attempt ended for the first.
UPDATE idemproxy.attempts
SET checks = checks + 1, checked_at = now()
WHERE owner = $1 AND job_id = $2 AND number = $3 AND checks = $5
  AND coalesce(checked_at, finished_at, started_at) <= now() - make_interval(secs => $6)
  AND EXISTS (SELECT 1 FROM idemproxy.jobs
              WHERE owner = $1 AND id = $2 AND state = 'unknown' AND version = $4)
RETURNING checks;

-- name: record_evidence
-- SPEC §3.6: one question and its answer ($4, a JSON object) appended to the attempt's
-- evidence, of which the latest $5 are kept.
UPDATE idemproxy.attempts
SET evidence = (
    SELECT jsonb_agg(entry ORDER BY n)
    FROM (SELECT entry, n
          FROM jsonb_array_elements(coalesce(evidence, '[]'::jsonb) || jsonb_build_array($4::jsonb))
               WITH ORDINALITY AS e(entry, n)
          ORDER BY n DESC LIMIT $5) AS latest
)
WHERE owner = $1 AND job_id = $2 AND number = $3;

-- name: note_sent
-- SPEC §3.6: the digest of the request attempt $3 sent, on a route whose upstream honours keys.
UPDATE idemproxy.attempts SET sent_digest = $4
WHERE owner = $1 AND job_id = $2 AND number = $3;

-- name: resend_job
-- SPEC §3.6: of the retries of an `unknown` job, one wins this CAS and sends the request again
-- under the key its upstream honours, as a new attempt (inserted after, by `add_attempt_row`):
-- only while attempt $6, the one whose outcome is unknown, started less than $7 seconds ago by
-- the database clock (the upstream's window). $5: the caller's token (`started_by`). No longer
-- unknown, it has a `sweep_after` again, as a released job has (migration 0007).
WITH job AS (
    UPDATE idemproxy.jobs
    SET state = 'in_flight', version = version + 1, attempt_count = attempt_count + 1,
        lease_expires_at = now() + make_interval(secs => $4), updated_at = now(),
        started_by = $5, sweep_after = expires_at
    WHERE owner = $1 AND id = $2 AND version = $3 AND state = 'unknown'
      AND EXISTS (SELECT 1 FROM idemproxy.attempts AS a
                  WHERE a.owner = $1 AND a.job_id = $2 AND a.number = $6
                    AND a.started_at > now() - make_interval(secs => $7))
    RETURNING *
)
SELECT *, expires_at <= now() AS expired, false AS lease_expired FROM job;
