"""The upstream leg: the HTTP/1.1 client and the contract gate of fallbacks (SPEC §3.4, §10)."""
