"""The admin listener: health, readiness, the jobs API and metrics (SPEC §13)."""
