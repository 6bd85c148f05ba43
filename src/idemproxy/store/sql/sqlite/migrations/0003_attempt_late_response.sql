-- SPEC §3.3: a late response kept on its attempt (see the PostgreSQL migration).
ALTER TABLE attempts ADD COLUMN late_headers TEXT;
ALTER TABLE attempts ADD COLUMN late_body BLOB;
