-- The lease scan (SPEC §3.5, queries.sql `expired_leases`) finds every job in flight whose lease
-- ran out, whatever became of its attempts. It starts from the attempts by the lease each
-- started with (migration 0007), and an attempt now keeps that lease until its job leaves
-- `in_flight`, not merely until the attempt itself ends: a hedged race (SPEC §3.4) ends each
-- losing racer alone (`finish_attempt`) while the job goes on, and a proxy that dies after
-- ending the last racer and before settling the job leaves a job in flight with no attempt
-- running, which a scan of the running attempts never finds. So:
-- * the index holds the attempts that have a lease, whether or not they finished;
-- * `finish_attempt` keeps the attempt's lease while its job is in flight (on Citus it also
--   ends the attempt a fail-over leaves); `fail_over` clears the failed one's, the next attempt
--   holding the job's lease from then on;
-- * every statement that ends a job in flight (`complete` and its batch, `settle`, `take_over`)
--   clears the lease of all its attempts; a deletion drops them. A resolution starts from a
--   job these ended, whose attempts hold no lease any more.
-- Its predicate is a lower bound every lease passes (as `jobs_owner_id_idx`'s, migration 0005):
-- only a statement that names it can take this index. The ends of a job with several attempts
-- look for the ones with a lease among its attempts by the job's id (the primary key); given
-- an index of exactly the attempts with a lease (`IS NOT NULL`, which they imply), a planner
-- with statistics took it instead, reading every attempt in flight
-- (tests/store/test_pg_point_lookups.py). The completion's HOT concerns `jobs` alone.
DROP INDEX idemproxy.attempts_lease_idx;
CREATE INDEX attempts_lease_idx ON idemproxy.attempts (lease_expires_at)
    WHERE lease_expires_at > '-infinity';
-- The attempts of jobs that ended before this migration keep no lease (a hedged job settled
-- while another racer ran left that racer's lease behind).
UPDATE idemproxy.attempts a SET lease_expires_at = NULL
FROM idemproxy.jobs j
WHERE j.owner = a.owner AND j.id = a.job_id AND j.state <> 'in_flight'
  AND a.lease_expires_at IS NOT NULL;
-- A job in flight whose attempts all ended already (the gap itself) gets its lease back on its
-- latest attempt, the job's own: never later than the job's, which the scan checks.
UPDATE idemproxy.attempts a SET lease_expires_at = j.lease_expires_at
FROM idemproxy.jobs j
WHERE j.owner = a.owner AND j.id = a.job_id AND j.state = 'in_flight'
  AND a.number = j.attempt_count AND a.lease_expires_at IS NULL;
