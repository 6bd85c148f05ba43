-- The embedded store: the same tables and constraints as PostgreSQL (SPEC §11).
-- Times are Unix seconds from SQLite's own clock.
CREATE TABLE jobs (
    owner            TEXT    NOT NULL,
    key              TEXT    NOT NULL,
    id               TEXT    NOT NULL UNIQUE,
    fingerprint      TEXT    NOT NULL,
    method           TEXT    NOT NULL,
    path             TEXT    NOT NULL,
    state            TEXT    NOT NULL DEFAULT 'in_flight'
                     CHECK (state IN ('in_flight', 'completed', 'released', 'unknown')),
    version          INTEGER NOT NULL DEFAULT 1,
    attempt_count    INTEGER NOT NULL DEFAULT 1,
    completed_by     INTEGER,
    response_status  INTEGER,
    response_headers TEXT,
    response_body    BLOB,
    response_omitted INTEGER NOT NULL DEFAULT 0,
    lease_expires_at REAL,
    resolution       TEXT,
    created_at       REAL    NOT NULL,
    updated_at       REAL    NOT NULL,
    expires_at       REAL    NOT NULL,
    PRIMARY KEY (owner, key),
    UNIQUE (owner, id),
    CHECK (state <> 'completed' OR (completed_by IS NOT NULL AND response_status IS NOT NULL))
);
CREATE INDEX jobs_expiry_idx ON jobs (expires_at) WHERE state IN ('completed', 'released');
CREATE INDEX jobs_unknown_idx ON jobs (created_at) WHERE state = 'unknown';

CREATE TABLE attempts (
    owner            TEXT    NOT NULL,
    job_id           TEXT    NOT NULL,
    number           INTEGER NOT NULL,
    upstream         TEXT    NOT NULL,
    state            TEXT    NOT NULL DEFAULT 'started'
                     CHECK (state IN ('started', 'succeeded', 'failed', 'unknown', 'discarded')),
    status           INTEGER,
    error            TEXT,
    started_at       REAL    NOT NULL,
    finished_at      REAL,
    lease_expires_at REAL,
    PRIMARY KEY (owner, job_id, number),
    FOREIGN KEY (owner, job_id) REFERENCES jobs (owner, id) ON DELETE CASCADE
);
