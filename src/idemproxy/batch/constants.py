"""Defaults and wire values of the batch runner (SPEC §14).

Header names and problem codes are the proxy's own (`idemproxy.constants`, `idemproxy.errors`).
"""

from __future__ import annotations

from typing import Final

# Bumped if the results line format ever changes incompatibly.
RECORD_VERSION: Final = 1

DEFAULT_KEY_PREFIX: Final = "batch"
KEY_PREFIX_MAX_LENGTH: Final = 64
# Ids longer than this, or with characters outside the safe set, enter the key as a hash.
KEY_ID_MAX_LENGTH: Final = 100
# Hex digits of the request hash that go into the key (96 bits: edits never collide).
KEY_HASH_LENGTH: Final = 24

DEFAULT_CONCURRENCY: Final = 4
DEFAULT_RETRIES: Final = 6
DEFAULT_TIMEOUT_SECONDS: Final = 120.0
DEFAULT_BACKOFF_BASE: Final = 0.5
DEFAULT_BACKOFF_MAX: Final = 30.0
# A Retry-After beyond this is treated as this, so one bad header cannot park a worker for hours.
RETRY_AFTER_CAP_SECONDS: Final = 300.0

# SPEC §3.2: the upstream says it did not process the request (408, 425, 429, 503), or a gateway
# failed (502, 504) — retrying under the same key is safe: the proxy replays or reports unknown.
TRANSIENT_STATUSES: Final = frozenset({408, 425, 429, 502, 503, 504})
# SPEC §3.2: a gateway that failed (an upstream's own, not the proxy's: those say so) may have
# passed the request on, so the item may have executed.
GATEWAY_FAILURES: Final = frozenset({502, 504})

USER_AGENT: Final = "idemproxy-batch"
