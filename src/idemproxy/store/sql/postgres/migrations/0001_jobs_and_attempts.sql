-- SPEC §11: jobs and attempts as separate tables. `owner` leads every key so that both tables
-- can be distributed by owner (Citus) when one server is not enough.
CREATE TABLE idemproxy.jobs (
    owner            text        NOT NULL,
    key              text        NOT NULL,
    id               uuid        NOT NULL,
    fingerprint      text        NOT NULL,
    method           text        NOT NULL,
    path             text        NOT NULL,
    state            text        NOT NULL DEFAULT 'in_flight'
                     CHECK (state IN ('in_flight', 'completed', 'released', 'unknown')),
    -- The compare-and-swap token: every state change bumps it (SPEC §1, seed "Jobs and Attempts").
    version          integer     NOT NULL DEFAULT 1,
    attempt_count    integer     NOT NULL DEFAULT 1,
    completed_by     integer,
    response_status  integer,
    response_headers jsonb,
    response_body    bytea,
    response_omitted boolean     NOT NULL DEFAULT false,
    -- SPEC §3.5: while in flight, the lease of its live attempts, renewed by the proxy running
    -- them. Past it (by the database clock) the next request takes the job over as `unknown`.
    lease_expires_at timestamptz,
    -- Set by the first held duplicate: only then does a state change cost a NOTIFY, which
    -- PostgreSQL serialises across the whole server at commit.
    watched          boolean     NOT NULL DEFAULT false,
    -- How an operator or unknown_ttl settled an `unknown` job (SPEC §3.3); NULL otherwise.
    resolution       text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    expires_at       timestamptz NOT NULL,
    -- SPEC §2.2: the job is locked by this unique constraint, never by check-then-insert.
    PRIMARY KEY (owner, key),
    UNIQUE (owner, id),
    CHECK (state <> 'completed' OR (completed_by IS NOT NULL AND response_status IS NOT NULL))
);

-- Operators and waiters look jobs up by id alone.
CREATE INDEX jobs_id_idx ON idemproxy.jobs (id);
-- SPEC §11: the sweeper only ever deletes terminal jobs, oldest first.
CREATE INDEX jobs_expiry_idx ON idemproxy.jobs (expires_at) WHERE state IN ('completed', 'released');
-- Operators list unknown jobs (SPEC §3.3). Partial: an index over every state made the
-- completion's CAS walk all in-flight entries on a big store instead of one (owner, id) lookup.
CREATE INDEX jobs_unknown_idx ON idemproxy.jobs (created_at) WHERE state = 'unknown';

CREATE TABLE idemproxy.attempts (
    owner            text        NOT NULL,
    job_id           uuid        NOT NULL,
    number           integer     NOT NULL,
    upstream         text        NOT NULL,
    state            text        NOT NULL DEFAULT 'started'
                     CHECK (state IN ('started', 'succeeded', 'failed', 'unknown', 'discarded')),
    status           integer,
    error            text,
    started_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    lease_expires_at timestamptz,
    PRIMARY KEY (owner, job_id, number),
    FOREIGN KEY (owner, job_id) REFERENCES idemproxy.jobs (owner, id) ON DELETE CASCADE
);
