"""The pure core: plain data and every transition of jobs and attempts, no I/O, no clock (SPEC §2,
§3)."""
