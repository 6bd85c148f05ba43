-- SPEC §9: the quotas' count of an owner's jobs in flight (queries.sql `quota_usage`) reads
-- those jobs alone, not every job of the owner. No index of `jobs` may name `state` or
-- `lease_expires_at`, which the completion changes (migration 0007: it is HOT), so the count
-- starts from the owner's attempts that hold a lease: since migration 0009 an attempt keeps the
-- lease it started with until its job leaves `in_flight`, so these are the attempts of the
-- owner's jobs in flight, live or dead, and a job in flight has at least one. Each is then one
-- lookup of its job by id, on the job's lease as renewed. The attempt's end already clears its
-- lease (that of `attempts_lease_idx`): the new version has no entry here either; a new key
-- writes one more index entry, on its first attempt (docs/benchmarks.md, "Write cost").
-- Its predicate is the lease scan's (`> '-infinity'`, migration 0009), which only the statements
-- that name it imply: no statement that looks up a job's attempts by `owner` and `job_id`
-- (the primary key's columns) can take this index for one of its own.
CREATE INDEX attempts_owner_leased_idx ON idemproxy.attempts (owner, job_id)
    WHERE lease_expires_at > '-infinity';
