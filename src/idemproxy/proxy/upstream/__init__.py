"""The upstream leg: what is sent (target), the HTTP/1.1 client and the contract gate of fallbacks
(SPEC §3.4, §10)."""
