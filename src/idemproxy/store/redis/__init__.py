"""Redis: the replay cache and cross-replica wake-ups in front of a store (optional)."""
