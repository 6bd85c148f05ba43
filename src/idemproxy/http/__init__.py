"""Wire helpers shared by the proxy, the admin listener and the operator tools (SPEC §7, §8,
§10)."""
