"""A request's identity: its key, its owner and its fingerprint (SPEC §4-§6), and job ids."""
