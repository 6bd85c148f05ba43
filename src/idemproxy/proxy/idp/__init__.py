"""Owner JWT keys from an identity provider: fetched, cached and refreshed (SPEC §5)."""
