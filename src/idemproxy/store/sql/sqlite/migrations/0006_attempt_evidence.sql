-- SPEC §3.6: questions about an `unknown` attempt and their answers: see the PostgreSQL
-- migration 0008.
ALTER TABLE attempts ADD COLUMN checks INTEGER NOT NULL DEFAULT 0;
ALTER TABLE attempts ADD COLUMN checked_at REAL;
ALTER TABLE attempts ADD COLUMN evidence TEXT;
ALTER TABLE attempts ADD COLUMN sent_digest TEXT;
