"""Wire names and defaults: header names, problem codes, metric and Redis key prefixes, and the
defaults that settings and several modules share. A number used in one module only is named
there."""

from __future__ import annotations

from typing import Final

# Request and response headers (SPEC §4, §7, §8, §10).
DEFAULT_KEY_HEADER: Final = "Idempotency-Key"
DEFAULT_REQUEST_ID_HEADER: Final = "X-Request-Id"
JOB_HEADER: Final = "Idempotency-Job"
ATTEMPT_HEADER: Final = "Idempotency-Attempt"
REPLAYED_HEADER: Final = "Idempotent-Replayed"
REPLAY_OMITTED_HEADER: Final = "Idempotency-Replay"
ERROR_HEADER: Final = "Idempotency-Error"
PROBLEM_TYPE_PREFIX: Final = "urn:idemproxy:problem:"
# SPEC §8: a problem about a job names it as its `instance` (RFC 9457 §3.1.5).
JOB_INSTANCE_PREFIX: Final = "urn:idemproxy:job:"
PROBLEM_CONTENT_TYPE: Final = "application/problem+json"

# RFC 9110 §7.6.1: hop-by-hop headers never cross the proxy in either direction.
HOP_BY_HOP_HEADERS: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)

# SPEC §10: what a client may claim about the hops before this proxy; believed only from a
# trusted proxy, dropped from anyone else (http/headers.py `outgoing`).
FORWARDING_HEADERS: Final = frozenset(
    {
        "forwarded",  # RFC 7239
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-forwarded-host",
        "x-forwarded-port",
        "x-forwarded-prefix",
        "x-forwarded-server",
        "x-forwarded-ssl",
        "x-forwarded-scheme",
        "x-forwarded-uri",
        "x-forwarded-path",
        # The client's address as other proxies and CDNs name it.
        "x-real-ip",
        "true-client-ip",
        "x-client-ip",
        "x-cluster-client-ip",
        "cf-connecting-ip",
        # The path some frameworks (IIS, Symfony) route by instead of the request line's: from
        # a client, a way past this proxy's routing (and a route's require_key).
        "x-original-url",
        "x-rewrite-url",
    }
)

# SPEC §7: not stored or replayed by default (per-user or per-challenge values).
DEFAULT_UNREPLAYED_HEADERS: Final = ("set-cookie", "www-authenticate", "proxy-authenticate")

# SPEC §3.2 default attempt outcomes by upstream status.
DEFAULT_RELEASE_STATUSES: Final = (408, 425, 429, 503)
DEFAULT_UNKNOWN_STATUSES: Final = (502, 504)

# Media types of responses that are streams of events (SPEC §2 step 4): sent to the first client
# as they arrive and stored once they end, rather than read whole before the client sees a byte.
STREAMING_MEDIA_TYPES: Final = frozenset({"text/event-stream", "application/x-ndjson"})

# Defaults (SPEC §9, §11, §12).
DEFAULT_LISTEN: Final = "127.0.0.1:8080"
DEFAULT_ADMIN_LISTEN: Final = "127.0.0.1:9090"
DEFAULT_STORE: Final = "sqlite:///idemproxy.db"
DEFAULT_METHODS: Final = ("POST", "PATCH")
DEFAULT_TTL_SECONDS: Final = 86_400
DEFAULT_UPSTREAM_TIMEOUT: Final = 30.0
DEFAULT_CONNECT_TIMEOUT: Final = 5.0
MAX_WAIT_MARGIN_SECONDS: Final = 5.0
# SPEC §10 `forward_host`: the Host an upstream receives. `auto` is `client` for an http://
# upstream and `upstream` for an https:// one; any other value is the Host itself.
DEFAULT_FORWARD_HOST: Final = "auto"
FORWARD_HOST_MODES: Final = frozenset({"auto", "client", "upstream"})
DEFAULT_MAX_REQUEST_BODY: Final = 10 * 1024 * 1024
DEFAULT_MAX_STORED_BODY: Final = 8 * 1024 * 1024
DEFAULT_MAX_WAITERS_PER_KEY: Final = 64
DEFAULT_MAX_WAITERS: Final = 10_000
# limits.response_buffer and limits.max_connections, per process (docs/operations.md, Memory).
DEFAULT_RESPONSE_BUFFER: Final = 256 * 1024 * 1024
DEFAULT_RESPONSE_BUFFER_WAIT: Final = 1.0
DEFAULT_RESPONSE_BUFFER_HOLD: Final = 10.0
DEFAULT_MAX_CONNECTIONS: Final = 1024
DEFAULT_BACKLOG: Final = 1024
# server.workers: each worker holds its own store pool, so a typo must not open thousands.
MAX_WORKERS: Final = 64
# server.parse_processes: each holds a parsed body (several times its size) while it works.
MAX_PARSE_PROCESSES: Final = 64
DEFAULT_RETRY_AFTER_SECONDS: Final = 1
# SPEC §3.5, pool.lease_connections: renewals are short statements; more is a typo.
MAX_LEASE_CONNECTIONS: Final = 16
# A lease renewal is due after a third of the lease; a try (up to pool.store_timeout) must
# end within the two thirds left.
LEASE_RENEWAL_SHARE: Final = 2 / 3
KEY_MAX_LENGTH: Final = 255
# Bytes of header fields (`Name: value` CRLF) an operator's resolution may store (SPEC §3.3),
# on top of the per-field and count limits of `server`: every client of the job gets them.
MAX_RESOLVED_HEADER_BYTES: Final = 64 * 1024
# The admin API's and `jobs list`'s owner filter: an owner scope is a SHA-256 hex digest or a
# fixed word (SPEC §5); anything longer or outside visible ASCII names no owner.
OWNER_FILTER_MAX_LENGTH: Final = 255

# Who settled an `unknown` job, as recorded in its `resolution` (SPEC §3.3).
RESOLUTION_OPERATOR: Final = "operator"
RESOLUTION_UNKNOWN_TTL: Final = "unknown_ttl"
# SPEC §3.6: an `unknown` job resolved by the backend's reconcile endpoint, or by the answer of
# an upstream that honours the key to the request sent again under it.
RESOLUTION_RECONCILE: Final = "reconcile"
RESOLUTION_UPSTREAM_KEY: Final = "upstream_key"
DEFAULT_RECONCILE_TIMEOUT: Final = 5.0
DEFAULT_RECONCILE_BACKOFF: Final = 5.0
DEFAULT_RECONCILE_MAX_BACKOFF: Final = 300.0
# How often each proxy looks for `unknown` jobs due a question (proxy/background/reconcile.py).
DEFAULT_RECONCILE_INTERVAL: Final = 1.0
# Evidence entries kept per attempt (SPEC §3.6): the latest ones; `checks` counts them all.
MAX_EVIDENCE_ENTRIES: Final = 20
# Characters of a reconcile answer's reason kept as evidence.
MAX_EVIDENCE_DETAIL: Final = 200

# Owner scopes that are not hashes of a credential (SPEC §5).
ANONYMOUS_OWNER: Final = "anonymous"
GLOBAL_OWNER: Final = "global"
# A webhook route's jobs belong to its sender (SPEC §4.2): `webhook:<sender>`, never a hash.
WEBHOOK_OWNER_PREFIX: Final = "webhook:"
# `owner.pepper` (SPEC §5): the HMAC key of every owner; shorter, it no longer stops a copy of
# the store from testing guesses of a short credential (docs/operations.md asks for 32 random
# bytes).
MIN_PEPPER_BYTES: Final = 32
MIN_PEPPER_DISTINCT_BYTES: Final = 10

# Webhook senders' headers (SPEC §4.2): Standard Webhooks, GitHub, Stripe.
STANDARD_WEBHOOK_ID: Final = "webhook-id"
STANDARD_WEBHOOK_TIMESTAMP: Final = "webhook-timestamp"
STANDARD_WEBHOOK_SIGNATURE: Final = "webhook-signature"
GITHUB_DELIVERY: Final = "X-GitHub-Delivery"
GITHUB_SIGNATURE: Final = "X-Hub-Signature-256"
STRIPE_SIGNATURE: Final = "Stripe-Signature"
# Both Standard Webhooks and Stripe's libraries default to five minutes.
DEFAULT_WEBHOOK_TOLERANCE_SECONDS: Final = 300.0

# The `jwt` owner strategy (SPEC §5). "none" is never an algorithm: tokens must be signed.
DEFAULT_JWT_CLAIM: Final = "sub"
# Keys from an identity provider (`owner.jwt.jwks_uri`, `discovery`): how often they are
# fetched again, how often at most (whatever asks: an unknown kid, a short max-age), and how long
# one fetch, and so a request waiting for it, may take.
DEFAULT_JWKS_REFRESH_SECONDS: Final = 300.0
DEFAULT_JWKS_MIN_REFRESH_SECONDS: Final = 30.0
DEFAULT_JWKS_TIMEOUT_SECONDS: Final = 5.0
MAX_JWKS_BYTES: Final = 1024 * 1024  # a JWKS or discovery document larger than this is refused
DEFAULT_JWT_LEEWAY_SECONDS: Final = 30.0
MAX_JWT_LEEWAY_SECONDS: Final = 300.0
JWT_HMAC_ALGORITHMS: Final = ("HS256", "HS384", "HS512")
JWT_ALGORITHMS: Final = (
    *JWT_HMAC_ALGORITHMS,
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512",
    "ES256", "ES384", "ES512", "ES256K", "EdDSA",
)  # fmt: skip

# Prometheus metric names start with this (SPEC §13).
METRIC_PREFIX: Final = "idemproxy"

# PostgreSQL channel that carries job state changes to every replica (SPEC §11).
NOTIFY_CHANNEL: Final = "idemproxy_jobs"
# A held duplicate re-reads the job at least this often even without a wake-up, so that a
# lost notification (dropped LISTEN connection) delays an answer but never loses it.
WAITER_RECHECK_SECONDS: Final = 2.0

# Redis, the optional replay cache and wake-up channel (SPEC §11). Entries are named by a hash
# of (owner, key); tombstones mark deleted jobs so that a late cache write cannot bring one back.
REDIS_JOB_PREFIX: Final = "idemproxy:job:"
REDIS_GONE_PREFIX: Final = "idemproxy:gone:"
REDIS_CHANNEL: Final = "idemproxy:jobs"
# A held duplicate marks its (owner, key) watched for this long; changes to jobs that nobody
# watches are not published, as with PostgreSQL NOTIFY (each replica would read every message).
REDIS_WATCH_PREFIX: Final = "idemproxy:watch:"
REDIS_WATCH_SECONDS: Final = 300
# After a Redis error, lookups skip the cache this long before it is tried again.
REDIS_RETRY_SECONDS: Final = 1.0
# A cached replay (Redis or in-process) is given up this long before its job expires by the
# database's clock (which decides expiry, SPEC §3.5), as this host measures it against its own
# (store/postgres/listen.py): slack for that measurement's error and for drift between measurements.
CLOCK_MARGIN_SECONDS: Final = 1.0
