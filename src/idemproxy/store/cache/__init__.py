"""Replay caches in front of a store: the shared base and the in-process one."""
