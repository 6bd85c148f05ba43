-- SPEC §9: the quotas' count of an owner's jobs in flight (queries.sql `quota_usage`) reads
-- those jobs alone, not every job of the owner through its `(owner, id)` key. Keyed by the
-- owner only: a lease renewal, which changes no column this index names, writes nothing to it.
CREATE INDEX IF NOT EXISTS jobs_owner_in_flight_idx ON jobs (owner) WHERE state = 'in_flight';
