-- Every hot statement is a point lookup whatever the planner's statistics say. A table that was
-- never analyzed (a fresh, restored or bulk-loaded store; a server without autovacuum) leaves
-- the planner nothing to tell two indexes apart by: a generic plan made while the table was
-- small took `UNIQUE (owner, id)` for `owner = $1 AND key = $2`, with `key` a mere filter, and
-- kept it while the owner's jobs grew (a claim then read every job of its owner). So no index
-- but the one a statement looks up leads with that statement's equality columns (a B-tree can
-- still test `owner = $1` over a whole index that holds `owner` further on: an equality lookup
-- of a unique key costs less, so the batches look each key up alone, queries.sql):
-- * by key (claim, get, watch): `(key, owner)`, the primary key; no other index leads by key.
-- * by id (complete, settle, renew, the attempt changes, the attempts' foreign key): `(id, owner)`,
--   which also serves operators' lookups by id alone (the former `jobs_id_idx`).
-- * a range of one owner's ids (quotas' recent jobs, erasure, reseal): `(owner, id)`, partial on a
--   predicate that is always true (`id >= ` the nil UUID) and that no statement implies unless
--   it names it: only the statements that name it can use this index (queries.sql, at its head).
-- * attempts: `(job_id, number, owner)`, so that no index of attempts leads by owner alone;
--   one owner's kept late responses (quotas, reseal) have a partial index of their own.
-- * the lease index holds the jobs that have a lease (in flight): its predicate names no state,
--   so that the compare-and-swaps (`state = 'in_flight'`) cannot take it for a scan of every job
--   in flight.
-- `owner` stays in every key (Citus distributes both tables by it, SPEC §11). Rebuilds the
-- indexes of `jobs` once; stored jobs and attempts are unchanged.
ALTER TABLE idemproxy.attempts DROP CONSTRAINT attempts_owner_job_id_fkey;
ALTER TABLE idemproxy.jobs DROP CONSTRAINT jobs_owner_id_key;
ALTER TABLE idemproxy.jobs DROP CONSTRAINT jobs_pkey;
ALTER TABLE idemproxy.jobs ADD CONSTRAINT jobs_pkey PRIMARY KEY (key, owner);
ALTER TABLE idemproxy.jobs ADD CONSTRAINT jobs_id_owner_key UNIQUE (id, owner);
DROP INDEX idemproxy.jobs_id_idx;
CREATE INDEX jobs_owner_id_idx ON idemproxy.jobs (owner, id)
    WHERE id >= '00000000-0000-0000-0000-000000000000'::uuid;
ALTER TABLE idemproxy.attempts DROP CONSTRAINT attempts_pkey;
ALTER TABLE idemproxy.attempts ADD CONSTRAINT attempts_pkey PRIMARY KEY (job_id, number, owner);
CREATE INDEX attempts_late_idx ON idemproxy.attempts (owner, job_id, number)
    WHERE late_body IS NOT NULL;
ALTER TABLE idemproxy.attempts ADD CONSTRAINT attempts_owner_job_id_fkey
    FOREIGN KEY (owner, job_id) REFERENCES idemproxy.jobs (owner, id) ON DELETE CASCADE;
DROP INDEX idemproxy.jobs_lease_idx;
CREATE INDEX jobs_lease_idx ON idemproxy.jobs (lease_expires_at)
    WHERE lease_expires_at IS NOT NULL;
