"""The exception tree. Every error the proxy answers itself derives from `IdemproxyError`.

    IdemproxyError                  (500, never leaves the process as-is)
    ├── ProblemError                an answer for the client (SPEC §8)
    │   ├── KeyMissing              400 key-missing
    │   ├── KeyInvalid              400 key-invalid
    │   ├── HeaderInvalid           400 header-invalid
    │   ├── PathInvalid             400 path-invalid
    │   ├── OwnerMissing            401 owner-missing
    │   ├── OwnerUnstable           400 owner-unstable (a per-request signature, SPEC §5)
    │   ├── SignatureInvalid        401 signature-invalid (a webhook route, SPEC §4.2)
    │   ├── KeyNotFound             404 key-not-found (the status lookup, SPEC §7.1)
    │   ├── PayloadMismatch         409 payload-mismatch (422 in the ietf profile)
    │   ├── RequestInFlight         409 request-in-flight + Retry-After
    │   ├── OutcomeUnknown          409 outcome-unknown
    │   │   └── JobLost             409 outcome-unknown: the job went away under its attempt
    │   ├── NoRoute                 404 no-route
    │   ├── EncodingNotAcceptable   406 encoding-not-acceptable (a replay, SPEC §7)
    │   ├── RequestTimeout          408 request-timeout
    │   ├── ClientDisconnected      499 client-disconnected (logged and counted, never sent)
    │   ├── BodyTooLarge            413 body-too-large
    │   ├── ExpectationFailed       417 expectation-failed (an Expect other than 100-continue)
    │   ├── UpstreamUnavailable     502 upstream-unavailable
    │   ├── ContractViolation       502 contract-violation
    │   ├── StoreUnavailable        503 store-unavailable + Retry-After
    │   │   └── StoreRefused        the same answer; the store refused this write's data
    │   ├── IdentityUnavailable     503 identity-unavailable + Retry-After
    │   ├── TooManyWaiters          503 too-many-waiters + Retry-After
    │   ├── ShuttingDown            503 shutting-down + Retry-After (and Connection: close)
    │   ├── QuotaExceeded           429 quota-exceeded + Retry-After (SPEC §9)
    │   ├── UpstreamTimeout         504 upstream-timeout
    │   ├── ResponseUnreadable      500 response-unreadable (sealed, and its key is gone)
    │   └── OperatorError           the admin jobs API and `idemproxy jobs` (SPEC §3.3, §13)
    │       ├── InvalidRequest      400 invalid-request
    │       ├── Unauthorized        401 unauthorized
    │       ├── JobNotFound         404 job-not-found
    │       ├── JobNotUnknown       409 job-not-unknown
    │       ├── VersionMismatch     409 version-mismatch
    │       ├── ResolutionLost      409 resolution-lost
    │       ├── DeletionLost        409 deletion-lost
    │       ├── NoLateResponse      409 no-late-response
    │       └── JobInFlight         409 job-in-flight
    ├── ConfigError                 bad settings, raised at start-up
    └── ListenFailed                a configured address cannot be listened on (in use, …)

Docstrings are the default `detail` of each problem, as one line: their line breaks and
indentation are source layout, not text for a client (RFC 9457 §3.1.4: a human-readable
explanation).
"""

from __future__ import annotations

from typing import ClassVar, Final


def one_line(text: str) -> str:
    """`text` with every run of whitespace (a docstring's line breaks and indentation) as one
    space."""
    return " ".join(text.split())


class IdemproxyError(Exception):
    """Internal error."""

    def __init__(self, detail: str | None = None) -> None:
        self.detail = detail or one_line(self.__doc__ or "")
        super().__init__(self.detail)


class ConfigError(IdemproxyError):
    """Invalid configuration."""


class NotDistributable(IdemproxyError):
    """`idemproxy migrate --distribute` cannot distribute the store's tables as SPEC §11 needs."""


class ListenFailed(IdemproxyError):
    """A configured address cannot be listened on."""


# SPEC §8: what a client may do next, in every problem document of a governed request.
SAME_KEY: Final = "same-key"  # retry the same request with the same key (after Retry-After)
NEW_KEY_SAFE: Final = (
    "new-key-safe"  # nothing of it ran: a (corrected) request under a new key is safe
)
NEVER: Final = "never"  # it may have executed: no retry, with this key or another one
NO_JOB: Final = "none"  # the `job_state` of a request that has no job


class ProblemError(IdemproxyError):
    """The proxy could not process the request."""

    code: ClassVar[str] = "internal-error"
    status: ClassVar[int] = 500
    title: ClassVar[str] = "Internal error"
    # Seconds for Retry-After: the class's, or one error's own (IdentityUnavailable, QuotaExceeded).
    retry_after: int | None = None
    # The SPEC §8 rule of this code. An instance may say otherwise (a pass-through request that
    # may have reached its upstream), and a job whose state is `unknown` always makes it `never`.
    retry: str = SAME_KEY
    # The state a job is in whenever this problem is answered, whatever state it was last read in.
    fixed_state: ClassVar[str | None] = None
    # The job this answer is about and its state, once known (http/problems.py writes them).
    job_id: str | None = None
    job_state: str | None = None
    # Extension members of this answer's problem document (RFC 9457 §3.2), in the proxy's words.
    members: dict[str, object] | None = None

    def about(self, job_id: str, state: str) -> ProblemError:
        """This problem, about job `job_id` in `state`, unless it already names a job or is
        about none (`about_no_job`, or a code whose `fixed_state` is `none`)."""
        if self.job_id is None and self.job_state is None and self.fixed_state != NO_JOB:
            self.job_id = job_id
            self.job_state = self.fixed_state or state
        return self

    def about_no_job(self) -> ProblemError:
        """This problem, about no job (SPEC §8): raised by a claim that did not take, such as
        a re-claim after the job under the key was forgotten, it names no job, not the
        forgotten one."""
        if self.job_id is None:
            self.job_state = NO_JOB
        return self


class KeyMissing(ProblemError):
    """This route requires an Idempotency-Key header."""

    code, status, title = "key-missing", 400, "Idempotency key missing"
    retry = NEW_KEY_SAFE


class KeyInvalid(ProblemError):
    """The Idempotency-Key header must be one value of 1-255 visible ASCII characters."""

    code, status, title = "key-invalid", 400, "Idempotency key invalid"
    retry = NEW_KEY_SAFE


class KeyAmbiguous(KeyInvalid):
    """The body repeats the member name on the key's path (RFC 8259 §4 leaves which value counts
    to the parser): the key cannot be told, and the request was not forwarded."""

    # SPEC §4.1: refused whatever `require_key` says: passed through untracked, the intent it
    # names might run once per retry.


class HeaderInvalid(ProblemError):
    """A header that identifies or routes the request is repeated, malformed or in Connection."""

    code, status, title = "header-invalid", 400, "Header invalid"
    retry = NEW_KEY_SAFE


class PathInvalid(ProblemError):
    """The request path may not contain dot segments or empty segments, encoded or not."""

    code, status, title = "path-invalid", 400, "Path invalid"
    retry = NEW_KEY_SAFE


class OwnerMissing(ProblemError):
    """This route requires a credential that identifies the owner of the key."""

    code, status, title = "owner-missing", 401, "Owner missing"
    retry = NEW_KEY_SAFE


class OwnerUnstable(ProblemError):
    """The request's credential is a signature made for this request alone, so a retry signed
    again would be another owner and could execute again; nothing was claimed or forwarded.
    The proxy needs an owner that stays the same on every try: owner.strategy header:<NAME>
    (set by a gateway that verified the signature), jwt, or none."""

    # SPEC §5. 400 (RFC 9110 §15.5.1: the proxy will not process it as sent), not 401: the
    # credential may be good for the backend, which the proxy does not verify, and a 401 must
    # carry a challenge (§15.5.2) for a scheme that would work, which the proxy cannot name.
    code, status, title = "owner-unstable", 400, "Owner changes on every try"
    retry = NEW_KEY_SAFE  # nothing was claimed: under a stable owner, any key is safe


class SignatureInvalid(ProblemError):
    """The webhook delivery is not signed with this route's secret, or its timestamp is
    stale."""

    code, status, title = "signature-invalid", 401, "Signature invalid"
    retry = NEW_KEY_SAFE  # nothing was claimed: a delivery signed right may go under any key


class KeyNotFound(ProblemError):
    """No job of yours has this idempotency key."""

    code, status, title = "key-not-found", 404, "Key not found"
    retry = NEW_KEY_SAFE  # no job of this owner has the key: nothing of it executed


class PayloadMismatch(ProblemError):
    """This Idempotency-Key was already used with a different request payload."""

    code, status, title = "payload-mismatch", 409, "Idempotency key reused with another payload"
    retry = NEW_KEY_SAFE


class RequestInFlight(ProblemError):
    """A request with this Idempotency-Key is still being processed; retry later."""

    code, status, title = "request-in-flight", 409, "Request in flight"
    retry_after = 1


class OutcomeUnknown(ProblemError):
    """The outcome of the earlier request with this key is unknown; an operator must resolve it."""

    code, status, title = "outcome-unknown", 409, "Outcome unknown"
    retry = NEVER
    fixed_state = "unknown"


class JobLost(OutcomeUnknown):
    """This request's job was deleted or settled by an operator while its attempt ran: the
    upstream may have executed it, and its outcome was not stored. A retry with this key may run
    it again."""


class NoRoute(ProblemError):
    """No upstream is configured for this host and path."""

    code, status, title = "no-route", 404, "No route"
    retry = NEW_KEY_SAFE


class EncodingNotAcceptable(ProblemError):
    """The stored response of this job has a content coding that this request does not accept
    (Accept-Encoding) and that the proxy cannot decode; it was not forwarded. Send it again with
    the same Idempotency-Key and an Accept-Encoding that names the coding."""

    # SPEC §7, RFC 9110 §15.5.7: the one answer there is cannot be given in a form the client
    # reads, and executing the request again for another form is what the key forbids.
    code, status, title = "encoding-not-acceptable", 406, "Stored response's coding not accepted"


class BodyEncodingUnsupported(ProblemError):
    """The route reads its key from the JSON body, and this request's body has a content coding
    the proxy cannot undo (only `gzip` and `deflate`), or bytes that are not what the coding
    says, or more than `max_request_body` once decoded: nothing was claimed or forwarded."""

    # SPEC §4.1, RFC 9110 §15.5.16: a body whose key cannot be read is never passed through
    # untracked (it may be an intent that already ran), whatever `require_key` says.
    code, status, title = "body-encoding-unsupported", 415, "Request body's coding unsupported"
    retry = NEW_KEY_SAFE


class RequestTimeout(ProblemError):
    """The request body did not arrive in time."""

    code, status, title = "request-timeout", 408, "Request timeout"


class ClientDisconnected(ProblemError):
    """The client closed the connection before its request body was complete."""

    # nginx's 499: nobody receives this answer, but the request line and the metrics need one.
    code, status, title = "client-disconnected", 499, "Client closed request"


class ExpectationFailed(ProblemError):
    """The request's `Expect` is one the proxy does not know: only `100-continue` has a meaning
    (RFC 9110 §10.1.1); nothing was read, claimed or forwarded."""

    code, status, title = "expectation-failed", 417, "Expectation failed"
    retry = NEW_KEY_SAFE


class BodyInvalid(ProblemError):
    """The request body's framing is broken (a chunk size that is no hexadecimal number, a
    missing line end): nothing of the request was claimed, and a governed one was not forwarded.
    The connection is closed after the answer: where the next request would begin is unknown."""

    code, status, title = "body-invalid", 400, "Request body framing invalid"
    retry = NEW_KEY_SAFE


class BodyTooLarge(ProblemError):
    """The request body exceeds the configured limit."""

    code, status, title = "body-too-large", 413, "Request body too large"
    retry = NEW_KEY_SAFE


class UpstreamUnavailable(ProblemError):
    """The upstream could not be reached or sent an invalid response."""

    code, status, title = "upstream-unavailable", 502, "Upstream unavailable"


class ContractViolation(ProblemError):
    """The upstream answered, but its response breaks this route's response contract. The
    request may have executed: it is not run again with this Idempotency-Key, and its outcome
    is unknown until an operator resolves it."""

    code, status, title = "contract-violation", 502, "Upstream response breaks the contract"
    retry = NEVER
    fixed_state = "unknown"


class StoreUnavailable(ProblemError):
    """The idempotency store is unavailable; the request was not forwarded."""

    code, status, title = "store-unavailable", 503, "Store unavailable"
    retry_after = 1


class StoreUnreachable(StoreUnavailable):
    """The idempotency store is unavailable; the request was not forwarded."""

    # Opening the store at start-up failed. `reason` is for the person who started the command
    # (cli.main): it names the server or file, so it is never a client's answer.
    def __init__(self, reason: str | None = None) -> None:
        super().__init__()
        self.reason = reason or self.detail


class StoreRefused(StoreUnavailable):
    """The idempotency store is unavailable; the request was not forwarded."""

    # The client's answer is a StoreUnavailable's (SPEC §11: no driver text). The difference
    # is for the proxy's follow-ups (proxy/background/followups.py): the store is there and refused
    # this statement for its data (PostgreSQL SQLSTATE classes 22, 23 and 54, asyncpg's own
    # DataError for a value it cannot encode; SQLite's DataError and IntegrityError, a text
    # that is not UTF-8). Trying it again gets the same refusal, and says nothing about the
    # store's health.


class IdentityUnavailable(ProblemError):
    """The bearer token could not be verified: the identity provider's keys could not be
    fetched. Nothing was forwarded; retry later."""

    # SPEC §5, §8: fail closed. The token may be good (signed with a key just rotated in), so
    # this is no 401 telling the client its credential is bad; nor is it forwarded unscoped.
    code, status, title = "identity-unavailable", 503, "Identity provider unavailable"
    retry_after = 5

    def __init__(self, detail: str | None = None, *, retry_after: int | None = None) -> None:
        super().__init__(detail)
        if retry_after is not None:
            self.retry_after = retry_after  # when the keys may next be fetched (SPEC §5)


class TooManyWaiters(ProblemError):
    """Too many requests are waiting for this key or in total; retry later."""

    code, status, title = "too-many-waiters", 503, "Too many waiters"
    retry_after = 1


class ShuttingDown(ProblemError):
    """The proxy is shutting down and took no new request; nothing was forwarded. Retry with
    the same Idempotency-Key."""

    code, status, title = "shutting-down", 503, "Shutting down"
    retry_after = 1


class QuotaExceeded(ProblemError):
    """This owner is over one of its quotas; nothing was claimed or forwarded. Retry with the
    same Idempotency-Key after Retry-After."""

    code, status, title = "quota-exceeded", 429, "Quota exceeded"
    retry_after = 1
    fixed_state = NO_JOB  # SPEC §8: refused before anything is claimed

    def __init__(self, detail: str | None = None, *, retry_after: int = 1) -> None:
        super().__init__(detail)
        self.retry_after = retry_after


class UpstreamTimeout(ProblemError):
    """The upstream did not answer in time; the outcome of the request is unknown."""

    code, status, title = "upstream-timeout", 504, "Upstream timeout"
    retry = NEVER
    fixed_state = "unknown"


class ResponseUnreadable(ProblemError):
    """The stored response of this job cannot be opened; the request was not forwarded."""

    # SPEC §8, §11: the job completed, so forwarding the request would execute it a second
    # time, and the sealed bytes are no answer: refused until an operator restores the key.
    # Not a StoreUnavailable: `on_store_error: passthrough` must not forward it either.
    code, status, title = "response-unreadable", 500, "Stored response unreadable"


class OperatorError(ProblemError):
    """The operator request could not be carried out."""


class InvalidRequest(OperatorError):
    """The request is not valid."""

    code, status, title = "invalid-request", 400, "Invalid request"


class Unauthorized(OperatorError):
    """This admin endpoint needs the admin bearer token."""

    code, status, title = "unauthorized", 401, "Unauthorized"


class JobNotFound(OperatorError):
    """No job has this id."""

    code, status, title = "job-not-found", 404, "Job not found"


class JobNotUnknown(OperatorError):
    """Only a job in state `unknown` can be resolved; nothing was changed."""

    code, status, title = "job-not-unknown", 409, "Job not unknown"


class VersionMismatch(OperatorError):
    """The job changed since the version given; nothing was changed."""

    code, status, title = "version-mismatch", 409, "Version mismatch"


class ResolutionLost(OperatorError):
    """Another change to the job won the compare-and-swap first; nothing was changed."""

    code, status, title = "resolution-lost", 409, "Resolution lost"


class DeletionLost(OperatorError):
    """The job changed since it was read (another change won the compare-and-swap first);
    nothing was deleted."""

    code, status, title = "deletion-lost", 409, "Deletion lost"


class NoLateResponse(OperatorError):
    """That attempt kept no late response to resolve the job with; nothing was changed."""

    code, status, title = "no-late-response", 409, "No late response"


class JobInFlight(OperatorError):
    """The job is in flight with a live lease; deleting it could allow a second execution."""

    code, status, title = "job-in-flight", 409, "Job in flight"
