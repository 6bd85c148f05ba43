-- A completion, a lease renewal, a release and a watch update the job in place (HOT): PostgreSQL
-- writes no index entry for an update that changes no column any index of the table names, as
-- a key or in its predicate, when the new version fits on the same page. The completion changes
-- `state`, `lease_expires_at` and `expires_at`, so no index of `jobs` may name them:
-- * the sweep (SPEC §11) reads `sweep_after`, a time no later than the job's expiry that the
--   completion leaves as it is: the claim's expiry (the completion's is later, as ttl counts
--   from the completion; `complete` lowers it only when a shorter ttl makes that one earlier).
--   The sweep then deletes the jobs whose `expires_at` passed among them (queries.sql).
-- * `sweep_after` is NULL exactly while the job is `unknown` (never swept, SPEC §3.1; the CHECK
--   keeps the two in step): the operators' list of unknown jobs (SPEC §3.3) is the index of the
--   jobs without one. A predicate `IS NULL` is also what a planner without statistics takes
--   for a small part of the table, as it is.
-- * the lease scan (SPEC §3.5, `expired_leases`) starts from the attempts not finished, by the
--   lease each started with: a job's lease, renewed on the job alone, is never earlier than the
--   one its latest attempt started with, so each job whose lease ran out is found among them.
--   The predicate names `finished_at`, which no statement on the hot path names: none of them
--   can take this index for a scan of every attempt in flight (migration 0005).
-- The fillfactor leaves room on each page for the completed versions of the jobs claimed there:
-- a batch of completions (store/batching.py) updates the jobs one batch of claims put side by
-- side, in one transaction, so none of their old versions is pruned before all new ones are
-- written. bench/write_cost.py: up to 16 keys at a time, every completion HOT at 80 (and at 90);
-- 32 at a time, 56 % at 80, 86 % at 50, 100 % at 40, for a heap about 1/fillfactor as large.
-- Sets `sweep_after` of every stored job once (a rewrite of `jobs`). The default is a safe
-- lower bound for a job inserted without one (by hand): every sweep reads it until it expires.
ALTER TABLE idemproxy.jobs ADD COLUMN sweep_after timestamptz DEFAULT now();
UPDATE idemproxy.jobs SET sweep_after = CASE WHEN state <> 'unknown' THEN expires_at END;
ALTER TABLE idemproxy.jobs ADD CONSTRAINT jobs_sweep_after_check
    CHECK ((state = 'unknown') = (sweep_after IS NULL));
DROP INDEX idemproxy.jobs_expiry_idx;
DROP INDEX idemproxy.jobs_unknown_idx;
DROP INDEX idemproxy.jobs_lease_idx;
CREATE INDEX jobs_sweep_idx ON idemproxy.jobs (sweep_after);
CREATE INDEX jobs_unknown_idx ON idemproxy.jobs (created_at) WHERE sweep_after IS NULL;
CREATE INDEX attempts_lease_idx ON idemproxy.attempts (lease_expires_at)
    WHERE finished_at IS NULL;
ALTER TABLE idemproxy.jobs SET (fillfactor = 80);
