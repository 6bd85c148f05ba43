"""Why a request failed, as one word of a closed set (the `reason` log field, SPEC §13).

An operator filtering logs at 3 a.m. needs `reason=connect-refused`, not the exception text of
whichever library raised it; the set is closed so that a dashboard or an alert can match on it.
"""

from __future__ import annotations

import enum
import ssl
from typing import assert_never

from idemproxy.core.machine import Failure
from idemproxy.proxy.upstream.client import UpstreamFailure

# The h1 client's own refusals of what the upstream sent (proxy/upstream/client.py): not a broken
# connection but an answer that is not valid HTTP/1.1.
_INVALID_RESPONSE_PREFIXES = (
    "invalid upstream response",
    "upstream response head too large",
    "upstream switched protocols",
)


class FailureReason(enum.StrEnum):
    CONNECT_REFUSED = "connect-refused"  # nothing listens on the upstream's port
    CONNECT_TIMEOUT = "connect-timeout"  # no connection within pool.connect_timeout
    CONNECT_FAILED = "connect-failed"  # DNS, an unreachable network, an unusable upstream URL
    TLS = "tls"  # the TLS handshake or the TLS layer failed
    TIMEOUT = "timeout"  # the request was sent; no (complete) answer within upstream_timeout
    RESET = "reset"  # the connection broke or was closed after the request was sent
    INVALID_RESPONSE = "invalid-response"  # the upstream's answer was not valid HTTP/1.1
    CONTRACT = "contract"  # a 2xx that broke the route's response contract (SPEC §3.4)
    STORE = "store"  # the store could not take the request or its outcome (SPEC §11)


def upstream_reason(failure: UpstreamFailure) -> FailureReason:
    """The reason for a failed upstream call, by the exception under it and how far it got."""
    cause = failure.__cause__ or failure.__context__
    if isinstance(cause, ssl.SSLError | ssl.CertificateError):
        return FailureReason.TLS
    match failure.failure:
        case Failure.CONNECT:
            if isinstance(cause, ConnectionRefusedError):
                return FailureReason.CONNECT_REFUSED
            if isinstance(cause, TimeoutError):
                return FailureReason.CONNECT_TIMEOUT
            return FailureReason.CONNECT_FAILED
        case Failure.TIMEOUT:
            return FailureReason.TIMEOUT
        case Failure.BROKEN:
            if failure.reason.startswith(_INVALID_RESPONSE_PREFIXES):
                return FailureReason.INVALID_RESPONSE
            return FailureReason.RESET
        case _:
            assert_never(failure.failure)
