"""Settings: read once from the file, the environment and the flags, then injected (SPEC §10)."""
