-- SPEC §11, encryption at rest (see the PostgreSQL migration).
ALTER TABLE jobs ADD COLUMN response_key TEXT;
ALTER TABLE attempts ADD COLUMN late_key TEXT;
