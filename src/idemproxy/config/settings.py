"""The settings model (SPEC §12): YAML file < environment (`IDEMPROXY_…`, nested with `__`) < flags.

Built once in `cli.main()` and passed in; nothing reads it from a global.
"""

from __future__ import annotations

import difflib
import ipaddress
import itertools
import json
import logging
import os
import re
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from idemproxy import constants as c
from idemproxy.config.keys import (
    KeySourceSettings,
    WebhookSettings,
    check_one_route_per_sender,
    key_header_name,
)
from idemproxy.config.quotas import QuotaSettings
from idemproxy.config.resolve import ResolveSettings
from idemproxy.config.secret_files import read_secret_files
from idemproxy.config.units import ByteSize, Duration
from idemproxy.config.upstream import (
    PROXY_HEADERS,
    UpstreamHeaderSettings,
    UpstreamSettings,
    UpstreamTlsSettings,
    check_proxy_url,
    check_tls_applies,
    key_headers_kept,
    origin_of,
)
from idemproxy.errors import ConfigError
from idemproxy.http.headers import host_name, valid_host
from idemproxy.redact import redact_url

_STRICT = ConfigDict(extra="forbid")
log = logging.getLogger("idemproxy.config")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# RFC 9110 §5.1: field-name = token.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


class ContractSettings(BaseModel):
    """SPEC §3.4: the output contract a fallback must honour before it may take over."""

    model_config = _STRICT
    # JSON Schema that every 2xx response body of the group must validate against.
    schema_file: Path
    # JSONL file of sample requests: {"method", "path", "headers"?, "body"?} per line.
    samples_file: Path
    # Seconds between re-checks of the fallbacks; 0 checks only at start-up.
    interval: Duration = Field(default=300.0, ge=0)
    # Longest a check of one sample may take, its upstream timeout included.
    timeout: Duration = Field(default=10.0, gt=0)

    @field_validator("schema_file", "samples_file")
    @classmethod
    def _exists(cls, path: Path) -> Path:
        if not path.is_file():
            raise ValueError(f"no such file: {path}")
        return path


class RouteSettings(BaseModel):
    """A path prefix (and optionally a host) routed to an upstream group (SPEC §3.4, §10)."""

    model_config = _STRICT
    prefix: str = "/"
    host: str | None = None
    upstream: str
    # Ordered fallbacks: a released outcome moves on to the next one as a new attempt.
    fallbacks: list[str] = Field(default_factory=list)
    # Start one more attempt on the next upstream after this many seconds without a response.
    # Only for side-effect-free upstreams (LLM inference): both attempts may execute.
    hedge_after: Duration | None = Field(default=None, gt=0)
    contract: ContractSettings | None = None
    require_key: bool | None = None  # overrides the global setting for this route
    ttl: Duration | None = Field(default=None, gt=0)
    # Overrides the global `upstream_timeout` for this route's upstreams.
    upstream_timeout: Duration | None = Field(default=None, gt=0)
    # Headers set (a provider's API key, from env:NAME or file:PATH) or removed upstream.
    upstream_headers: UpstreamHeaderSettings = Field(default_factory=UpstreamHeaderSettings)
    # SPEC §4.1: the key from another header or the JSON body; unset: `key_header`.
    key: KeySourceSettings | None = None
    # SPEC §4.2: a webhook receiver, its deliveries verified and owned by their sender.
    webhook: WebhookSettings | None = None
    # SPEC §10: the Host the upstream receives: auto, client, upstream, or a fixed host[:port].
    forward_host: str = c.DEFAULT_FORWARD_HOST
    # SPEC §3.6: how this route's `unknown` jobs may resolve themselves; none by default.
    resolve: ResolveSettings = Field(default_factory=ResolveSettings)

    @field_validator("forward_host")
    @classmethod
    def _forward_host(cls, value: str) -> str:
        return check_forward_host(value)

    @field_validator("fallbacks")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        return [check_upstream_url(url) for url in urls]

    @model_validator(mode="after")
    def _hedge_needs_a_fallback(self) -> RouteSettings:
        if self.hedge_after is not None and not self.fallbacks:
            raise ValueError("hedge_after needs at least one fallback to hedge on")
        return self

    @field_validator("prefix")
    @classmethod
    def _absolute(cls, prefix: str) -> str:
        if not prefix.startswith("/"):
            raise ValueError("must start with '/'")
        return prefix

    @field_validator("upstream")
    @classmethod
    def _http_url(cls, url: str) -> str:
        return check_upstream_url(url)


class IdpSettings(BaseModel):
    """How the keys of `owner.jwt.jwks_uri` or `discovery` are fetched (SPEC §5)."""

    model_config = _STRICT
    # Fetched again at least this often; a shorter Cache-Control max-age brings it forward.
    refresh_interval: Duration = Field(default=c.DEFAULT_JWKS_REFRESH_SECONDS, gt=0)
    # Never fetched more often than this, whatever asks (a token's unknown kid, max-age 0): a
    # flood of forged kids makes one fetch per interval at most.
    min_refresh_interval: Duration = Field(default=c.DEFAULT_JWKS_MIN_REFRESH_SECONDS, gt=0)
    # Longest one fetch (discovery and JWKS) may take, and so a request waiting for it.
    timeout: Duration = Field(default=c.DEFAULT_JWKS_TIMEOUT_SECONDS, gt=0)
    # TLS to the identity provider, as to an upstream: a CA bundle, a client certificate.
    tls: UpstreamTlsSettings = Field(default_factory=UpstreamTlsSettings)

    @model_validator(mode="after")
    def _bounds_in_order(self) -> IdpSettings:
        if self.min_refresh_interval > self.refresh_interval:
            raise ValueError("min_refresh_interval must not be longer than refresh_interval")
        return self


class JwtSettings(BaseModel):
    """SPEC §5, strategy `jwt`: the owner is a claim of a bearer JWT verified with `key`, or
    with the keys an identity provider publishes (`jwks_uri`, or `discovery` from `issuer`)."""

    model_config = _STRICT
    # A PEM public key or certificate file, a JWKS file, or env:NAME (an HMAC secret).
    key: str | None = None
    # Or, instead of key, a file holding an HMAC secret (a mounted Secret). Never the secret
    # itself in the settings.
    secret_file: Path | None = None
    # Or the https:// URL of the identity provider's JWKS, fetched at start-up and refreshed.
    jwks_uri: str | None = None
    # Or true: the JWKS named by `issuer`'s OpenID Connect discovery document
    # (<issuer>/.well-known/openid-configuration), whose `issuer` must be `issuer` exactly.
    discovery: bool = False
    idp: IdpSettings = Field(default_factory=IdpSettings)
    # Never taken from the token; "none" is refused.
    algorithms: Annotated[list[str], NoDecode] = Field(default_factory=list)
    audience: Annotated[list[str], NoDecode] = Field(default_factory=list)
    issuer: str | None = None
    claim: str = Field(default=c.DEFAULT_JWT_CLAIM, min_length=1)
    leeway: Duration = Field(
        default=c.DEFAULT_JWT_LEEWAY_SECONDS, ge=0, le=c.MAX_JWT_LEEWAY_SECONDS
    )

    @property
    def remote(self) -> bool:
        """Whether the keys come from an identity provider (fetched, not read at start-up)."""
        return self.jwks_uri is not None or self.discovery

    @property
    def key_sources(self) -> list[str]:
        """The settings that give keys, by name (one is needed)."""
        given = {
            "owner.jwt.key": self.key is not None,
            "owner.jwt.secret_file": self.secret_file is not None,
            "owner.jwt.jwks_uri": self.jwks_uri is not None,
            "owner.jwt.discovery": self.discovery,
        }
        return [name for name, present in given.items() if present]

    @model_validator(mode="after")
    def _one_key(self) -> JwtSettings:
        sources = self.key_sources
        if len(sources) > 1:
            both = "both" if len(sources) == 2 else "all"
            raise ConfigError(f"{' and '.join(sources)} are {both} given: give only one")
        return self

    @model_validator(mode="after")
    def _remote_keys(self) -> JwtSettings:
        if self.discovery and not (self.issuer or "").startswith("https://"):
            raise ConfigError(
                "owner.jwt.discovery needs owner.jwt.issuer, an https:// URL (the discovery"
                " document is <issuer>/.well-known/openid-configuration)"
            )
        hmac = sorted(set(self.algorithms) & set(c.JWT_HMAC_ALGORITHMS))
        if self.remote and hmac:
            raise ConfigError(
                f"owner.jwt.algorithms: {', '.join(hmac)} needs a shared secret; an identity"
                " provider's JWKS holds public keys"
            )
        return self

    @field_validator("jwks_uri")
    @classmethod
    def _https(cls, url: str | None) -> str | None:
        if url is not None:
            check_https_url(url)
        return url

    @field_validator("algorithms", "audience", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("algorithms")
    @classmethod
    def _signed(cls, algorithms: list[str]) -> list[str]:
        for algorithm in algorithms:
            if algorithm.lower() == "none":
                raise ValueError('"none" is not an algorithm: tokens must be signed')
            if algorithm not in c.JWT_ALGORITHMS:
                raise ValueError(f"unknown algorithm; one of {', '.join(c.JWT_ALGORITHMS)}")
        return algorithms

    @field_validator("key")
    @classmethod
    def _env_name(cls, key: str | None) -> str | None:
        if key is not None and key.startswith("env:") and not _ENV_NAME.fullmatch(key[4:]):
            raise ValueError("env:NAME needs an environment variable name")
        return key


def _check_pepper(pepper: object, setting: str) -> None:
    """SPEC §5: an empty or short pepper is an HMAC under a guessable key while the operator
    believes owners are peppered. A ConfigError, not a ValueError: pydantic would echo the
    secret in its error."""
    value = pepper.get_secret_value() if isinstance(pepper, SecretStr) else pepper
    if not isinstance(value, str):
        return
    raw = value.encode()
    if len(raw) < c.MIN_PEPPER_BYTES or len(set(raw)) < c.MIN_PEPPER_DISTINCT_BYTES:
        # Distinct bytes, not entropy: no test tells random from chosen, but 32 spaces or one
        # character repeated is no secret (32 random bytes, hex or base64, have 16 or more).
        raise ConfigError(
            f"{setting}: the pepper must be at least {c.MIN_PEPPER_BYTES} bytes, random, with "
            f"at least {c.MIN_PEPPER_DISTINCT_BYTES} different ones (docs/operations.md, Owner "
            "pepper); remove it to run without one"
        )


def _check_pepper_ends(pepper: object, setting: str) -> None:
    """The same secret must give the same owners however it is given: `pepper_file` drops its
    final line break, so a pepper with whitespace, another line break or a byte order mark at
    its ends is refused, inline or in a file, rather than made another key than the same
    secret moved to the other form (every owner would change, and each retry execute again)."""
    value = pepper.get_secret_value() if isinstance(pepper, SecretStr) else pepper
    if isinstance(value, str) and (value != value.strip() or value.startswith("\ufeff")):
        raise ConfigError(
            f"{setting}: whitespace, a byte order mark or a line break at its ends (only a "
            "file's one final line break is dropped): remove it"
        )


class OwnerSettings(BaseModel):
    """SPEC §5: authorization | header:<NAME> | jwt | none."""

    model_config = _STRICT
    strategy: str = "authorization"
    required: bool = False
    jwt: JwtSettings = Field(default_factory=JwtSettings)
    # SPEC §5: owners are HMAC-SHA256 of the credential under this secret, not its plain
    # SHA-256, so a database dump does not let a short credential be guessed offline.
    pepper: SecretStr | None = None
    pepper_file: Path | None = None  # or read from this file (a mounted Secret)
    # The transition window from plain SHA-256 owners (docs/operations.md, Owner pepper): a
    # job under the owner the credential had before the pepper is found, replayed or held, and
    # never claimed afresh beside it.
    legacy_owners: bool = False

    @model_validator(mode="before")
    @classmethod
    def _pepper_file(cls, data: Any) -> Any:
        given = isinstance(data, dict) and data.get("pepper_file") not in (None, "")
        data = read_secret_files(data, ("pepper",), "owner.")
        if isinstance(data, dict) and data.get("pepper") is not None:
            setting = "owner.pepper_file" if given else "owner.pepper"
            _check_pepper(data["pepper"], setting)
            _check_pepper_ends(data["pepper"], setting)
        return data

    @model_validator(mode="after")
    def _legacy_needs_pepper(self) -> OwnerSettings:
        if self.legacy_owners and self.pepper is None:
            raise ValueError("owner.legacy_owners is the transition to owner.pepper: set both")
        return self

    @field_validator("strategy")
    @classmethod
    def _known(cls, strategy: str) -> str:
        try:
            check_strategy(strategy)
        except ConfigError as exc:
            raise ValueError("must be authorization, header:<NAME>, jwt or none") from exc
        return strategy

    @model_validator(mode="after")
    def _jwt_complete(self) -> OwnerSettings:
        if self.strategy == "jwt":
            missing = [
                f"owner.jwt.{name}"
                for name in ("key", "algorithms", "audience")
                if not getattr(self.jwt, name) and not (name == "key" and self.jwt.key_sources)
            ]
            if missing:
                raise ValueError(f"strategy jwt needs {', '.join(missing)}")
        return self


class OutcomeSettings(BaseModel):
    """SPEC §3.2: which upstream statuses release the job or make it unknown."""

    model_config = _STRICT
    release_statuses: list[int] = Field(default_factory=lambda: list(c.DEFAULT_RELEASE_STATUSES))
    unknown_statuses: list[int] = Field(default_factory=lambda: list(c.DEFAULT_UNKNOWN_STATUSES))

    @model_validator(mode="after")
    def _one_meaning_per_status(self) -> OutcomeSettings:
        # A status both released and unknown would be released: the attempt that may have
        # executed runs again. A success released runs every retry again (SPEC §3.2).
        both = sorted(set(self.release_statuses) & set(self.unknown_statuses))
        if both:
            raise ValueError(f"statuses in both release_statuses and unknown_statuses: {both}")
        for status in (*self.release_statuses, *self.unknown_statuses):
            if not 100 <= status <= 599:
                raise ValueError(f"{status} is no HTTP status")
        done = sorted(status for status in self.release_statuses if status < 400)
        if done:
            raise ValueError(
                f"release_statuses may name only error statuses (4xx, 5xx): {done} says the "
                "request was processed"
            )
        return self


class ServerSettings(BaseModel):
    """The client-facing listener (SPEC §9: deadlines well under aiohttp's 75 s default)."""

    model_config = _STRICT
    keepalive_timeout: Duration = Field(default=15.0, gt=0)
    # A request head must arrive in full within this many seconds of its first byte (of the
    # connection, for a new one): aiohttp has no such deadline (slowloris,
    # proxy/server/connection.py).
    header_read_timeout: Duration = Field(default=10.0, gt=0)
    body_read_timeout: Duration = Field(default=30.0, gt=0)
    # Governed request bodies larger than this many bytes wait on disk, not in memory; they are
    # fingerprinted as raw bytes (JSON canonicalisation applies up to this size).
    spool_threshold: ByteSize = Field(default=1024 * 1024, ge=0)
    max_line_size: ByteSize = Field(default=8190, gt=0)
    max_field_size: ByteSize = Field(default=8190, gt=0)
    # Header lines per request; aiohttp before 3.14 allowed 32768 (of max_field_size each).
    max_headers: int = Field(default=128, gt=0)
    shutdown_timeout: Duration = Field(default=30.0, ge=0)
    # Proxy processes sharing `listen` (SO_REUSEPORT) under one supervisor: the proxy is
    # CPU-bound in one event loop, so this is how one host uses more than one core.
    workers: int = Field(default=1, ge=1, le=c.MAX_WORKERS)
    # The Server field of the proxy's own answers (problems, admin); empty: none. An upstream's
    # answer, first or replayed, carries the upstream's Server field, or none (SPEC §10).
    server_token: str = Field(default="idemproxy", max_length=256, pattern=r"^[!-~]*( [!-~]+)*$")
    # Worker processes (per proxy process) that parse JSON bodies over 64 KiB for their key and
    # fingerprint (http/offload.py), started with the first; 0: on a thread of the proxy process,
    # which a large body then holds (SPEC §9).
    parse_processes: int = Field(default=2, ge=0, le=c.MAX_PARSE_PROCESSES)


class PoolSettings(BaseModel):
    model_config = _STRICT
    store_connections: int = Field(default=20, gt=0)
    store_timeout: Duration = Field(default=5.0, gt=0)
    upstream_connections: int = Field(default=256, gt=0)
    # Shorter than common upstream idle timeouts (Node.js: 5 s) so that a pooled connection is
    # rarely closed under a request: a POST cut off that way would leave its job unknown. 0:
    # every request on a connection of its own, sent with `Connection: close` (a backend that
    # writes after its answer; docs/operations.md, "Bytes from an upstream after its answer").
    upstream_keepalive: Duration = Field(default=4.0, ge=0)
    # PostgreSQL connections of each proxy process reserved for lease renewals (SPEC §3.5), on
    # top of store_connections: a renewal never waits behind request traffic for a connection.
    lease_connections: int = Field(default=2, ge=1, le=c.MAX_LEASE_CONNECTIONS)
    # Group commit (store/batching.py): claims (and completions) that arrive while one of their
    # statements is in flight go out together, at most this many (and 1 MiB of bodies) in one
    # statement and commit; a completion over 64 KiB always goes alone; 1 sends each alone.
    store_batch: int = Field(default=64, ge=1, le=1000)


class AdminSettings(BaseModel):
    """The admin listener: jobs API, /healthz, /readyz, /metrics (SPEC §13)."""

    model_config = _STRICT
    listen: str = c.DEFAULT_ADMIN_LISTEN
    # Bearer token for every admin request; required when `listen` is not a loopback address.
    token: SecretStr | None = None
    token_file: Path | None = None  # or read from this file (a mounted Secret)

    @model_validator(mode="before")
    @classmethod
    def _token_file(cls, data: Any) -> Any:
        return read_secret_files(data, ("token",), "admin.")

    @field_validator("listen")
    @classmethod
    def _host_port(cls, listen: str) -> str:
        parse_listen(listen)
        return listen

    @model_validator(mode="after")
    def _token_off_loopback(self) -> AdminSettings:
        host, _port = parse_listen(self.listen)
        token = None if self.token is None else self.token.get_secret_value()
        if not is_loopback(host) and not (token and token.strip()):
            # An empty token turned authentication off: the jobs of every owner on the network.
            # (Only an empty or blank one is refused here: nothing secret to echo.)
            raise ValueError(
                "admin.token is required when admin.listen is not a loopback address, and "
                "may not be empty or blank"
            )
        return self


class EncryptionSettings(BaseModel):
    """SPEC §11: stored responses sealed at rest (AES-256-GCM); off unless `keys` is given."""

    model_config = _STRICT
    # `id:base64` entries (32-byte keys), separated by commas or line breaks: the first seals
    # new responses, every one opens those sealed before (store/seal/keyring.py).
    keys: SecretStr | None = None
    keys_file: Path | None = None  # or read from this file (a mounted Secret)
    # Refuse every stored response in the clear (500 response-unreadable), so that someone
    # with write access to the database cannot plant one; turn on after a full
    # `idemproxy store reseal` (docs/operations.md). Needs `keys`.
    require_sealed: bool = False

    @model_validator(mode="before")
    @classmethod
    def _keys_file(cls, data: Any) -> Any:
        return read_secret_files(data, ("keys",), "encryption.")

    @model_validator(mode="after")
    def _require_sealed_needs_keys(self) -> EncryptionSettings:
        if self.require_sealed and self.keys is None:
            raise ValueError("encryption.require_sealed needs encryption.keys")
        return self


class RedisSettings(BaseModel):
    """The optional Redis replay cache and cross-replica wake-ups in front of the store (the
    `redis:` block, SPEC §11); optional (pip install 'idemproxy[redis]'), never the source of
    truth."""

    model_config = _STRICT
    # redis://[:password@]host:port/db, rediss://… or unix://… (flag --redis); none: off.
    url: str | None = None
    url_file: Path | None = None  # or read from this file (a mounted Secret: it holds a password)

    @model_validator(mode="before")
    @classmethod
    def _url_file(cls, data: Any) -> Any:
        return read_secret_files(data, ("url",), "redis.")

    # Seconds a cache lookup may take; a slower (or failed) one is a miss, answered by the store.
    timeout: Duration = Field(default=0.05, gt=0)
    # Seconds for a cache write, invalidation or wake-up (in the background, never in a request).
    write_timeout: Duration = Field(default=0.5, gt=0)
    # Longest an entry is kept (never past its job's expiry): Redis holds about this many
    # seconds of completed responses, plus those replayed since.
    ttl: Duration = Field(default=300.0, gt=0)
    # Largest response body cached; larger ones are replayed from the store.
    max_body: ByteSize = Field(default=1024 * 1024, ge=0)

    @field_validator("url", mode="before")
    @classmethod
    def _scheme(cls, url: Any) -> Any:
        if url == "":
            return None  # IDEMPROXY_REDIS__URL="" (e.g. an empty secret) means off, as no url does
        if isinstance(url, str) and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be redis://…, rediss://… or unix://…")
        if isinstance(url, str):
            _check_authority(url)
        return url


class ReplayCacheSettings(BaseModel):
    """The in-process replay cache of completed jobs, in each proxy process, in front of a
    PostgreSQL store (`replay_cache`, SPEC §11; store/cache/memory.py). SQLite has none: its
    changes made by other processes (`idemproxy jobs delete`) are not announced."""

    model_config = _STRICT
    # Bytes of completed responses (plus about 1.2 KB per entry) kept per process; 0 turns the
    # cache off. The least recently replayed go first.
    max_bytes: ByteSize = Field(default=32 * 1024 * 1024, ge=0)
    # Largest response body kept; larger ones are replayed from the store.
    max_body: ByteSize = Field(default=256 * 1024, ge=0)
    # Longest an entry is kept (never past its job's expiry).
    ttl: Duration = Field(default=60.0, gt=0)


class LimitsSettings(BaseModel):
    """Per-process bounds on what many concurrent clients may make the proxy hold (SPEC §9)."""

    model_config = _STRICT
    # Bytes of response bodies held in memory at once (governed answers read for storing, their
    # store writes, and the answers to their first clients); a body that does not fit waits in
    # an unnamed temporary file instead (proxy/server/capture.py). Never a reason to refuse a
    # request.
    response_buffer: ByteSize = Field(default=c.DEFAULT_RESPONSE_BUFFER, ge=0)
    # Seconds a body on disk waits for room in the response buffer before its store write goes
    # ahead over it (an overdraft, counted in idemproxy_response_buffer_overdrafts_total): the
    # budget bounds memory, never how long a request waits.
    response_buffer_wait: Duration = Field(default=c.DEFAULT_RESPONSE_BUFFER_WAIT, gt=0)
    # Seconds a response being written to its client holds its bytes in the response buffer;
    # after it, a client that does not read no longer keeps room from every other response.
    response_buffer_hold: Duration = Field(default=c.DEFAULT_RESPONSE_BUFFER_HOLD, gt=0)
    # Client connections open at once; beyond it new ones wait in the kernel's listen backlog
    # (proxy/server/gate.py). Each takes a file descriptor: keep it under the process's
    # RLIMIT_NOFILE less pool.upstream_connections and pool.store_connections.
    max_connections: int = Field(default=c.DEFAULT_MAX_CONNECTIONS, gt=0)
    # Connections the kernel keeps waiting, accepted by it but not yet by the proxy (listen(2);
    # Linux caps it at net.core.somaxconn).
    backlog: int = Field(default=c.DEFAULT_BACKLOG, gt=0)


class TracingSettings(BaseModel):
    """OpenTelemetry traces (`pip install 'idemproxy[otel]'`, docs/operations.md, Tracing). The
    exporter, its endpoint, the sampler and the resource come from the standard `OTEL_*`
    environment variables, as for any other OpenTelemetry SDK."""

    model_config = _STRICT
    enabled: bool = False
    # Seconds the shutdown waits, after the drain, for the spans still queued to be exported.
    flush_timeout: Duration = Field(default=5.0, ge=0)


class StoreStartSettings(BaseModel):
    """How `serve` waits for a PostgreSQL store it cannot reach at start (a database starting
    beside the proxy): tries again, the pause doubling up to `max_backoff`, for `max_wait`
    seconds, then exits 1 (docs/deploy.md, Probes). A SQLite file is never waited for."""

    model_config = _STRICT
    max_wait: Duration = Field(default=60.0, ge=0)  # 0: exit at the first failure
    max_backoff: Duration = Field(default=5.0, gt=0)


class MetricsSettings(BaseModel):
    """`/metrics` on the admin listener (docs/operations.md, Metrics)."""

    model_config = _STRICT
    # Upper bounds (seconds) of the request and upstream duration histograms, ascending. Unset:
    # sub-millisecond to 60 s, then on up to the longest upstream timeout of any route.
    buckets: list[Duration] | None = Field(default=None, min_length=1)

    @field_validator("buckets")
    @classmethod
    def _ascending(cls, buckets: list[float] | None) -> list[float] | None:
        if buckets is not None and (
            buckets[0] <= 0 or any(a >= b for a, b in itertools.pairwise(buckets))
        ):
            raise ValueError("must be positive and strictly ascending, e.g. [0.01, 0.1, 1, 10]")
        return buckets


class SweeperSettings(BaseModel):
    model_config = _STRICT
    interval: Duration = Field(default=60.0, gt=0)
    batch_size: int = Field(default=500, gt=0)
    # SPEC §3.5: how often each proxy looks for jobs whose lease ran out at least one `lease`
    # ago (their proxy died) and takes them over as `unknown` (proxy/background/orphans.py).
    takeover_interval: Duration = Field(default=5.0, gt=0)
    # SPEC §3.6: how often each proxy looks for unknown jobs due a question to their route's
    # reconcile endpoint (proxy/background/reconcile.py); only with such a route.
    reconcile_interval: Duration = Field(default=c.DEFAULT_RECONCILE_INTERVAL, gt=0)


_ENV_PREFIX = "IDEMPROXY_"
# Headers that carry a caller's credential: never logged, so never the request id.
_CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})
# Headers the proxy frames, speaks or sets on the way upstream itself (SPEC §10): an id made up
# here goes upstream in the request id header, and would replace the proxy's own value there
# (X-Forwarded-For, Content-Length) or invent one (a job id, an idempotency key).
_PROXY_SET_HEADERS = PROXY_HEADERS | c.FORWARDING_HEADERS


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=_ENV_PREFIX, env_nested_delimiter="__", extra="forbid"
    )

    listen: str = c.DEFAULT_LISTEN
    upstream: str | None = None
    # Fallbacks and hedging for the `upstream` route (flags --fallback, --hedge-after).
    fallbacks: Annotated[list[str], NoDecode] = Field(default_factory=list)
    hedge_after: Duration | None = Field(default=None, gt=0)
    # SPEC §10: the Host the `upstream` route's upstream receives (flag --forward-host).
    forward_host: str = c.DEFAULT_FORWARD_HOST
    routes: list[RouteSettings] = Field(default_factory=list)
    store: str = c.DEFAULT_STORE
    # Or the DSN read from this file: it holds the database password (a mounted Secret).
    store_file: Path | None = None
    store_start: StoreStartSettings = Field(default_factory=StoreStartSettings)
    migrate: bool = True
    # NoDecode: IDEMPROXY_REDIS is read as it was before the block, a URL (_RenamedRedisKeys).
    redis: Annotated[RedisSettings, NoDecode] = Field(default_factory=RedisSettings)
    _renamed_keys: tuple[str, ...] = PrivateAttr(default=())
    _unknown_variables: tuple[str, ...] = PrivateAttr(default=())
    replay_cache: ReplayCacheSettings = Field(default_factory=ReplayCacheSettings)
    encryption: EncryptionSettings = Field(default_factory=EncryptionSettings)
    profile: Literal["default", "ietf"] = "default"
    # SPEC §8: where docs/problems.md is published (https://…/problems.html); each problem's
    # `type` is then its anchor there. Unset: `urn:idemproxy:problem:<code>`.
    problem_types: str | None = None
    key_header: str = c.DEFAULT_KEY_HEADER
    # The request id: a client's value of this header (one, 1-200 visible ASCII), else one made
    # up here and sent upstream in it; in every log line and problem document of the request
    # (docs/operations.md, Logs). Empty: off.
    request_id_header: str = c.DEFAULT_REQUEST_ID_HEADER
    # SPEC §7.1: a GET with this header (e.g. Idempotency-Status: <key>) is answered with the
    # key's job state by the proxy, never forwarded. Unset (the default): no status lookup.
    status_header: str | None = None
    # NoDecode: IDEMPROXY_METHODS=POST,PUT is a comma list, not JSON (also for the lists below).
    methods: Annotated[list[str], NoDecode] = Field(default_factory=lambda: list(c.DEFAULT_METHODS))
    require_key: bool = False
    owner: OwnerSettings = Field(default_factory=OwnerSettings)
    ttl: Duration = Field(default=c.DEFAULT_TTL_SECONDS, gt=0)
    lease: Duration = Field(default=10.0, gt=0)
    # SPEC §3.3: auto-release unknown jobs unchanged for this many seconds. Off by default: only
    # turn it on when the upstream is known to drop requests it did not finish.
    unknown_ttl: Duration | None = Field(default=None, gt=0)
    upstream_timeout: Duration = Field(default=c.DEFAULT_UPSTREAM_TIMEOUT, gt=0)
    connect_timeout: Duration = Field(default=c.DEFAULT_CONNECT_TIMEOUT, gt=0)
    # --- the upstream leg (config/upstream.py, proxy/upstream/dial.py) ----------------------
    # TLS and egress proxy per upstream, keyed by its URL as the routes name it.
    upstreams: dict[str, UpstreamSettings] = Field(default_factory=dict)
    # http://[user:password@]host:port: the forward proxy every upstream is reached through
    # (HTTP CONNECT), unless its `upstreams` entry says otherwise.
    upstream_proxy: str | None = None
    # Without `upstream_proxy`: take the proxy from HTTPS_PROXY, HTTP_PROXY, ALL_PROXY and
    # NO_PROXY. Off by default: a sidecar's loopback upstream must not go through a corporate
    # proxy set in the environment for other programs.
    upstream_proxy_from_env: bool = False
    # --- end of the upstream leg ------------------------------------------------------------
    max_wait: Duration | None = Field(default=None, ge=0)
    max_request_body: ByteSize = Field(default=c.DEFAULT_MAX_REQUEST_BODY, ge=0)
    max_stored_body: ByteSize = Field(default=c.DEFAULT_MAX_STORED_BODY, ge=0)
    max_waiters_per_key: int = Field(default=c.DEFAULT_MAX_WAITERS_PER_KEY, gt=0)
    max_waiters: int = Field(default=c.DEFAULT_MAX_WAITERS, gt=0)
    fingerprint_exclude: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # SPEC §6: request headers whose values change what a request means to the backend beside
    # its body (`Stripe-Account`, `OpenAI-Organization`, `OpenAI-Project`: one credential acting
    # for several accounts), hashed with it when a request sends them.
    fingerprint_headers: Annotated[list[str], NoDecode] = Field(default_factory=list)
    unreplayed_headers: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(c.DEFAULT_UNREPLAYED_HEADERS)
    )
    outcomes: OutcomeSettings = Field(default_factory=OutcomeSettings)
    on_store_error: Literal["fail_closed", "passthrough"] = "fail_closed"
    # --- trusted_proxies (SPEC §10, http/headers.py `outgoing`) -------------------------------
    # Peers (CIDRs, or single addresses) whose X-Forwarded-*/Forwarded headers are kept, as
    # nginx's set_real_ip_from. Empty (the default): every peer is a client, and the proxy
    # sets X-Forwarded-For/Proto/Host from what it saw.
    trusted_proxies: Annotated[list[ipaddress.IPv4Network | ipaddress.IPv6Network], NoDecode] = (
        Field(default_factory=list)
    )

    @field_validator("trusted_proxies", mode="before")
    @classmethod
    def _networks(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(value, list):
            return value
        try:
            return [ipaddress.ip_network(str(entry).strip()) for entry in value]
        except ValueError as exc:  # "10.1.2.3/8" (host bits set) is a typo, not 10.0.0.0/8
            raise ValueError(f"trusted_proxies: {exc} (give CIDRs like 10.0.0.0/8)") from exc

    # --- end trusted_proxies ---------------------------------------------------------------

    @field_validator("key_header")
    @classmethod
    def _key_header_name(cls, name: str) -> str:
        # Not a header name (a blank, a line break), no request carries it: every request with
        # a key would pass through untracked, executed on every retry.
        return key_header_name(name)

    @field_validator("status_header")
    @classmethod
    def _status_header_name(cls, name: str | None) -> str | None:
        if name is not None and not _TOKEN.fullmatch(name):
            raise ValueError(f"{name!r} is not a header name")
        return name

    @field_validator("request_id_header")
    @classmethod
    def _request_id_header_name(cls, name: str) -> str:
        if name and not _TOKEN.fullmatch(name):
            raise ValueError(f"{name!r} is not a header name (empty turns request ids off)")
        return name

    server: ServerSettings = Field(default_factory=ServerSettings)
    pool: PoolSettings = Field(default_factory=PoolSettings)
    sweeper: SweeperSettings = Field(default_factory=SweeperSettings)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    quotas: QuotaSettings = Field(default_factory=QuotaSettings)  # SPEC §9, per owner
    admin: AdminSettings = Field(default_factory=AdminSettings)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["plain", "json"] = "plain"
    # One log line per governed request: outcome, job id, attempt, owner hash prefix, status.
    log_requests: bool = True
    # One line per pass-through request too, with the same fields (docs/operations.md, Logs).
    access_log: bool = False
    # The query string in the `path` field, with secret-looking parameters masked (redact.py).
    log_query: bool = False
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # SPEC §12: flags (init) > environment > YAML file.
        renamed = _RENAMED_KEYS.get()
        return (
            _RenamedRedisKeys(init_settings, renamed, where=None),
            _RenamedRedisKeys(env_settings, renamed, where="environment"),
            _RenamedRedisKeysInFile(settings_cls, renamed),
        )

    @model_validator(mode="before")
    @classmethod
    def _store_file(cls, data: Any) -> Any:
        return read_secret_files(data, ("store",), "")

    @field_validator("listen")
    @classmethod
    def _host_port(cls, listen: str) -> str:
        parse_listen(listen)
        return listen

    @field_validator("forward_host")
    @classmethod
    def _forward_host(cls, value: str) -> str:
        return check_forward_host(value)

    @field_validator("upstream")
    @classmethod
    def _upstream_url(cls, url: str | None) -> str | None:
        return None if url is None else check_upstream_url(url)

    @field_validator(
        "fallbacks",
        "fingerprint_exclude",
        "fingerprint_headers",
        "unreplayed_headers",
        mode="before",
    )
    @classmethod
    def _comma_lists(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("methods", mode="before")
    @classmethod
    def _methods(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):  # IDEMPROXY_METHODS='["POST","PATCH"]', as for other lists
                value = json.loads(text)
            else:
                value = [part for part in text.split(",") if part.strip()]
        if isinstance(value, list):
            if not all(isinstance(method, str) for method in value):
                # `[null]` would govern a method named NONE: every POST untracked.
                raise ValueError("methods: give method names as strings, e.g. POST, PATCH")
            return [method.strip().upper() for method in value]
        return value

    @field_validator("methods")
    @classmethod
    def _method_names(cls, methods: list[str]) -> list[str]:
        # None, or a name no request has: every request passes through untracked (SPEC §2).
        if not methods:
            raise ValueError("name at least one method to govern (default POST, PATCH)")
        for method in methods:
            if not _TOKEN.fullmatch(method):
                raise ValueError(f"{method!r} is not a method name (RFC 9110 §9.1)")
        return methods

    @field_validator("store")
    @classmethod
    def _store_scheme(cls, dsn: str) -> str:
        if not dsn.startswith(("sqlite://", "postgresql://", "postgres://")):
            raise ValueError("must be sqlite:///PATH or postgresql://…")
        return dsn

    @field_validator("fingerprint_headers")
    @classmethod
    def _header_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not _TOKEN.fullmatch(name):
                raise ValueError(f"{name!r} is not a header name (RFC 9110 §5.1)")
        lowered = [name.lower() for name in names]
        if len(set(lowered)) != len(lowered):
            raise ValueError("name each header once")
        return lowered

    @field_validator("fingerprint_exclude")
    @classmethod
    def _pointers(cls, pointers: list[str]) -> list[str]:
        for pointer in pointers:
            if not pointer.startswith("/"):
                raise ValueError(f"JSON pointer {pointer!r} must start with '/'")
        return pointers

    @model_validator(mode="after")
    def _has_upstream(self) -> Settings:
        if self.upstream is None and not self.routes:
            raise ValueError("upstream: set --upstream URL or at least one entry in routes")
        return self

    @field_validator("upstream_proxy")
    @classmethod
    def _proxy_url(cls, url: str | None) -> str | None:
        return None if url is None else check_proxy_url(url)

    @field_validator("upstreams")
    @classmethod
    def _upstream_keys(cls, upstreams: dict[str, UpstreamSettings]) -> dict[str, UpstreamSettings]:
        keyed = {check_upstream_url(url): options for url, options in upstreams.items()}
        by_origin: dict[tuple[str, int, bool], UpstreamSettings] = {}
        for url, options in keyed.items():
            check_tls_applies(url, options)
            # The client keeps connections per origin: one origin, one way to reach it.
            if by_origin.setdefault(origin_of(url), options) != options:
                raise ValueError(f"{url}: another entry names the same scheme, host and port")
        return keyed

    @model_validator(mode="after")
    def _upstreams_are_routed(self) -> Settings:
        routed = {url for route in self.all_routes for url in (route.upstream, *route.fallbacks)}
        for url in self.upstreams:
            if url not in routed:  # a typo would otherwise leave TLS settings unused in silence
                raise ValueError(f"upstreams: {url} is no route's upstream or fallback")
        return self

    @model_validator(mode="after")
    def _request_id_is_no_credential(self) -> Settings:
        """The request id is logged on every line and echoed in problem documents: a header
        that carries a credential (or the owner, SPEC §5) must never be it."""
        name = self.request_id_header.lower()
        owner = self.owner.strategy.removeprefix("header:").lower()
        if name in _CREDENTIAL_HEADERS or (
            self.owner.strategy.startswith("header:") and name == owner
        ):
            raise ValueError(
                f"request_id_header: {self.request_id_header} carries a credential; "
                "name another header (default X-Request-Id), or empty to turn ids off"
            )
        return self

    @model_validator(mode="after")
    def _request_id_is_no_proxy_header(self) -> Settings:
        # A route's own `key.header` may be the request id header: what a client sends there
        # goes upstream untouched, and an id is made up only when it sent none (http/headers.py).
        name = self.request_id_header.lower()
        if name == self.key_header.lower():
            why = "is the idempotency key header (key_header)"
        elif name in _PROXY_SET_HEADERS:
            why = "is framed, forwarded or set by the proxy itself (SPEC §10)"
        else:
            return self
        raise ValueError(
            f"request_id_header: {self.request_id_header} {why}, and an id made up here would "
            "go upstream in it; name another header (default X-Request-Id), or empty to turn "
            "ids off"
        )

    @model_validator(mode="after")
    def _one_route_per_sender(self) -> Settings:
        check_one_route_per_sender([(route.prefix, route.webhook) for route in self.routes])
        return self

    @model_validator(mode="after")
    def _key_headers_unchanged(self) -> Settings:
        kept = {self.key_header.lower(): "key_header"}
        for n, route in enumerate(self.routes):
            source = route.key or (route.webhook.default_key_source if route.webhook else None)
            if source is not None and source.header is not None:
                kept.setdefault(source.header.lower(), f"routes[{n}].key.header")
        for n, route in enumerate(self.routes):
            try:
                key_headers_kept(route.upstream_headers, kept)
            except ValueError as exc:
                raise ValueError(f"routes[{n}].upstream_headers: {exc}") from None
        for url, options in self.upstreams.items():
            try:
                key_headers_kept(options.headers, kept)
            except ValueError as exc:
                raise ValueError(f"upstreams.{url}.headers: {exc}") from None
        return self

    @model_validator(mode="after")
    def _one_route_per_prefix(self) -> Settings:
        # SPEC §10: the longest prefix wins, the first of equals: a second route that takes the
        # paths and host of another would never be used, its upstream, key source and limits
        # with it.
        seen: dict[tuple[str, str | None], int] = {}
        for n, route in enumerate(self.routes):
            where = _paths_taken(route)
            if where in seen:
                host = "" if route.host is None else f" and host {route.host}"
                raise ValueError(
                    f"routes[{n}] has the prefix {route.prefix}{host} of routes[{seen[where]}]: "
                    "it would never be used (give each route a prefix of its own)"
                )
            seen[where] = n
        return self

    @model_validator(mode="after")
    def _workers_need_postgres(self) -> Settings:
        # SQLite wakes held duplicates in-process only (store/watch.py): a duplicate held by one
        # worker would sleep through the completion written by another.
        if self.server.workers > 1 and self.store.startswith("sqlite://"):
            raise ValueError(
                "server.workers: more than one worker needs the PostgreSQL store; SQLite wakes "
                "held duplicates only within one process"
            )
        return self

    @field_validator("pool")
    @classmethod
    def _renewal_fits_in_the_lease(cls, pool: PoolSettings, info: ValidationInfo) -> PoolSettings:
        # SPEC §3.5: the first renewal is due after lease / 3, and one try may take up to
        # pool.store_timeout to fail; it must end before the lease does, with room to retry.
        lease = info.data.get("lease")  # absent when invalid itself (reported on its own)
        if lease is not None and pool.store_timeout >= lease * c.LEASE_RENEWAL_SHARE:
            raise ValueError(
                f"lease ({lease:g}s) and pool.store_timeout ({pool.store_timeout:g}s): a lease"
                " renewal, due after lease / 3, could take until after the lease ends; set"
                f" lease above {pool.store_timeout / c.LEASE_RENEWAL_SHARE:g}s"
                " (1.5 times pool.store_timeout) or lower pool.store_timeout"
            )
        return pool

    @property
    def renamed_keys(self) -> tuple[str, ...]:
        """A warning for each key of before that the file or the environment still gave."""
        return self._renamed_keys

    @property
    def unknown_variables(self) -> tuple[str, ...]:
        """A warning for each `IDEMPROXY_*` variable that names no setting (`unknown_variables`)."""
        return self._unknown_variables

    @property
    def effective_max_wait(self) -> float:
        """SPEC §2.3: by default a duplicate waits as long as the first attempt may take + 5 s."""
        if self.max_wait is not None:
            return self.max_wait
        return self.upstream_timeout + c.MAX_WAIT_MARGIN_SECONDS

    @property
    def longest_upstream_timeout(self) -> float:
        """The longest any upstream call may take, on any route (the histograms' reach)."""
        timeouts = [route.upstream_timeout for route in self.routes if route.upstream_timeout]
        return max([self.upstream_timeout, *timeouts])

    @property
    def unused_upstream(self) -> str | None:
        """A warning when `upstream`, the catch-all route `/` after the configured ones, is
        never used: a route of every path and any host comes first. Not refused, as a route
        of the same paths is: a deployment may set `upstream` for every proxy (the chart's
        sidecar mode does) and routes beside it."""
        if self.upstream is None:
            return None
        for n, route in enumerate(self.routes):
            if _paths_taken(route) == ("/", None):
                return (
                    f"upstream {redact_url(self.upstream)} is never used: routes[{n}] "
                    f"({route.prefix}) takes every path first"
                )
        return None

    @property
    def all_routes(self) -> list[RouteSettings]:
        """Configured routes, then `--upstream` as the catch-all route."""
        routes = list(self.routes)
        if self.upstream is not None:
            routes.append(
                RouteSettings(
                    prefix="/",
                    upstream=self.upstream,
                    fallbacks=self.fallbacks,
                    hedge_after=self.hedge_after,
                    forward_host=self.forward_host,
                )
            )
        return routes


def check_strategy(strategy: str) -> None:
    """SPEC §5: `owner.strategy` is authorization, header:<NAME>, jwt or none."""
    if strategy in ("authorization", "jwt", "none"):
        return
    # The name must be an RFC 9110 token exactly: "header: X-Tenant" would look up
    # " X-Tenant", never find it, and put every request in the shared anonymous scope.
    if not strategy.startswith("header:") or not _TOKEN.fullmatch(strategy[7:]):
        raise ConfigError("owner.strategy must be authorization, header:<NAME>, jwt or none")


def check_forward_host(value: str) -> str:
    """SPEC §10: `auto`, `client`, `upstream`, or the fixed Host value itself: a host[:port]
    (RFC 9110 §7.2) that is not empty, for it goes on the wire as it is written."""
    if value in c.FORWARD_HOST_MODES:
        return value
    # `Client` is a legal host name, but far likelier a misspelt mode than a Host to send.
    if not value or not valid_host(value) or value.lower() in c.FORWARD_HOST_MODES:
        raise ValueError("must be auto, client, upstream or a host[:port]")
    return value


def check_https_url(url: str) -> str:
    """An https:// URL with a host: keys fetched in the clear could be replaced on the way."""
    if not url.startswith("https://"):
        raise ValueError("must be an https:// URL")
    _check_authority(url)
    return url


def check_upstream_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError("must be an http:// or https:// URL")
    _check_authority(url)  # or every request would fail with a 500 and a traceback
    return url.rstrip("/")


def _check_authority(url: str) -> None:
    """A host, and a port that is a number: never echoing the URL (it may hold a password)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError("the port (or an IPv6 address in brackets) is malformed") from exc
    if not parts.hostname and not url.startswith("unix://"):
        raise ValueError("names no host")
    del port


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("must be HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Settings from the YAML file, the environment and explicit overrides (the CLI flags)."""

    class FileSettings(Settings):
        model_config = SettingsConfigDict(yaml_file=config_file)

    given = {k: v for k, v in overrides.items() if v is not None}
    renamed: list[str] = []
    token = _RENAMED_KEYS.set(renamed)
    try:
        settings = _load(FileSettings, config_file, given)
    finally:
        _RENAMED_KEYS.reset(token)
    settings._renamed_keys = tuple(dict.fromkeys(renamed))
    settings._unknown_variables = tuple(unknown_variables(os.environ))
    return settings


def log_settings_warnings(settings: Settings) -> None:
    """Warn once, at start-up, of each key of before the settings were read with, of each
    `IDEMPROXY_*` variable that was ignored, and of an `upstream` no request can reach."""
    unused = settings.unused_upstream
    for warning in (*settings.renamed_keys, *settings.unknown_variables, *filter(None, [unused])):
        log.warning("settings: %s", warning)


def _paths_taken(route: RouteSettings) -> tuple[str, str | None]:
    """The paths and host a route takes, as routing compares them (proxy/routing.py): a
    prefix ending in `/` takes the paths under it however many `/` end it (`/a//` takes all
    `/a/` does); one without takes itself as well."""
    prefix = route.prefix
    paths = prefix.rstrip("/") + "/" if prefix.endswith("/") else prefix
    return paths, None if route.host is None else host_name(route.host)


# IDEMPROXY_* variables that are not settings: the config file's path, and the test suite's own.
_NOT_SETTINGS = ("CONFIG", "TEST_")
_OLD_TOP_LEVEL = ("redis_options",)  # read by _RenamedRedisKeys, with a warning of its own


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each `IDEMPROXY_*` variable whose first part names no top-level setting.

    pydantic-settings ignores those in silence, so a typo (IDEMPROXY_TTLL) would leave the
    default in force unnoticed; an unknown key below a known one (IDEMPROXY_ADMIN__TOKN) is
    already refused by the nested model (extra="forbid").
    """
    known = [*Settings.model_fields, *_OLD_TOP_LEVEL]
    warnings = []
    for name in sorted(environ):
        if not name.upper().startswith(_ENV_PREFIX):
            continue
        rest = name[len(_ENV_PREFIX) :]
        if rest.upper().startswith(_NOT_SETTINGS):
            continue
        top, _, below = rest.partition("__")
        if top.lower() in known:
            continue
        close = difflib.get_close_matches(top.lower(), known, n=1)
        hint = ""
        if close:
            suggestion = _ENV_PREFIX + close[0].upper() + ("__" + below if below else "")
            hint = f" (did you mean {suggestion}?)"
        warnings.append(f"environment variable {name} names no setting and is ignored{hint}")
    return warnings


def _load(model: type[Settings], config_file: Path | None, given: dict[str, Any]) -> Settings:
    if config_file is None:
        return model(**given)
    try:
        return model(**given)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config: {yaml_problem(config_file, exc)}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config: cannot read {config_file}: {_reason(exc)}") from exc
    except ValueError as exc:  # pydantic's ValidationError is one too: let it name the field
        if isinstance(exc, ValidationError):
            raise
        # A document that is not a mapping (a list, a scalar) fails as the sources merge.
        raise ConfigError(f"config: {config_file} must be a YAML mapping of settings") from exc


def yaml_problem(path: Path, error: yaml.YAMLError) -> str:
    """`FILE, line L, column C: what` for a YAML syntax error (1-based, as editors count)."""
    if not isinstance(error, yaml.MarkedYAMLError) or error.problem_mark is None:
        return f"{path}: {error}"
    mark = error.problem_mark
    what = error.problem or "invalid YAML"
    if error.context:
        start = error.context_mark
        where = "" if start is None else f" at line {start.line + 1}, column {start.column + 1}"
        what = f"{what} ({error.context}{where})"
    return f"{path}, line {mark.line + 1}, column {mark.column + 1}: {what}"


def _reason(error: OSError | UnicodeDecodeError) -> str:
    if isinstance(error, UnicodeDecodeError):
        return f"not UTF-8 text (byte {error.start})"
    return error.strerror or str(error)


# The renamed keys the sources of one `load_settings` call read (None: not recorded).
_RENAMED_KEYS: ContextVar[list[str] | None] = ContextVar("idemproxy_renamed_keys", default=None)


class _RenamedRedisKeys(PydanticBaseSettingsSource):
    """One settings source, read with the Redis keys of before renamed: `redis: URL` is
    `redis: {url: URL}` and `redis_options: {…}` joins the `redis:` block.

    Each source is renamed on its own, so that the sources still merge key by key (an old
    IDEMPROXY_REDIS with a new `redis:` block in the file keeps both). A rename read from the
    file or the environment is noted for a warning at start-up (`log_settings_warnings`); the
    program's own arguments (the flags) are renamed quietly. One source giving a setting in both
    forms is refused: which one was meant cannot be told.
    """

    def __init__(
        self, source: PydanticBaseSettingsSource, notes: list[str] | None, *, where: str | None
    ) -> None:
        super().__init__(source.settings_cls)
        self._source, self._notes, self._where = source, notes, where

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._source.get_field_value(field, field_name)

    def __call__(self) -> dict[str, Any]:
        return self.rename(dict(self._source()))

    def rename(self, values: dict[str, Any]) -> dict[str, Any]:
        block = values.get("redis")
        options = values.pop("redis_options", None) or self._old_option_variables()
        if isinstance(block, dict) and options is not None:
            raise ConfigError(
                self._both("redis_options", "redis.*" if self._where == "environment" else "redis")
            )
        if isinstance(block, str):
            if self._nested_redis_variables():
                raise ConfigError(self._both("redis", "redis.url"))
            self._note("redis", "redis.url")
            block = {"url": block}
        if options is not None:
            self._note("redis_options", "redis.*" if self._where == "environment" else "redis")
            block = {**(block or {}), **options}
        if "redis" in values or options is not None:
            values["redis"] = block or {}
        return values

    def _old_option_variables(self) -> dict[str, Any] | None:
        # No field is named redis_options any more, so the environment source skips them: the
        # whole block as one JSON object (IDEMPROXY_REDIS_OPTIONS, as pydantic-settings reads a
        # nested model), with its members given one by one beside it taking precedence.
        env_vars = getattr(self._source, "env_vars", None)
        if self._where != "environment" or env_vars is None:
            return None
        whole = {name.lower(): value for name, value in env_vars.items()}.get(
            "idemproxy_redis_options"
        )
        found = {} if whole is None else _json_object("IDEMPROXY_REDIS_OPTIONS", whole)
        prefix = "idemproxy_redis_options__"
        found |= {
            name.lower().removeprefix(prefix): value
            for name, value in env_vars.items()
            if name.lower().startswith(prefix) and value is not None
        }
        return found or None

    def _nested_redis_variables(self) -> bool:
        # IDEMPROXY_REDIS is read as a URL (NoDecode), and then pydantic-settings would drop the
        # IDEMPROXY_REDIS__… variables beside it without a word.
        env_vars = getattr(self._source, "env_vars", None)
        if self._where != "environment" or env_vars is None:
            return False
        return any(name.lower().startswith("idemproxy_redis__") for name in env_vars)

    def _note(self, old: str, new: str) -> None:
        if self._notes is None or self._where is None:
            return
        if self._where == "environment":
            self._notes.append(f"{_ENV_NAMES[old]} is deprecated: set {_ENV_NAMES[new]} instead")
        else:
            self._notes.append(_FILE_NOTES[old])

    def _both(self, old: str, new: str) -> str:
        if self._where == "environment":
            block = _ENV_NAMES["redis.*"]
            return f"{_ENV_NAMES[old]} and {block} are both set: set only the {block} variables"
        where = "the flags" if self._where is None else "the config file"
        return f"`{old}` and `{new}` are both given in {where}: give only `{new}`"


def _json_object(name: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object of the redis settings")
    return value


class _RenamedRedisKeysInFile(YamlConfigSettingsSource):
    """The config file, read as `_RenamedRedisKeys` reads a source: a subclass rather than a
    wrapper, because pydantic-settings looks among the sources for its YAML one by its class."""

    def __init__(self, settings_cls: type[BaseSettings], notes: list[str] | None) -> None:
        super().__init__(settings_cls)
        self._renamed = _RenamedRedisKeys(self, notes, where="file")

    def __call__(self) -> dict[str, Any]:
        return self._renamed.rename(dict(super().__call__()))


_FILE_NOTES = {
    "redis": "`redis: URL` is deprecated: write `redis: {url: URL}` in the config file instead",
    "redis_options": "`redis_options:` is deprecated: move its settings into the `redis:` block"
    " of the config file",
}
# The environment variables of the renamed keys (env_prefix IDEMPROXY_, nested with `__`).
_ENV_NAMES = {
    "redis": "IDEMPROXY_REDIS",
    "redis.url": "IDEMPROXY_REDIS__URL",
    "redis.*": "IDEMPROXY_REDIS__…",
    "redis_options": "IDEMPROXY_REDIS_OPTIONS__…",
}
