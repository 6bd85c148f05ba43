"""Settings of the upstream leg: TLS and the egress proxy per upstream (`upstreams`), and the
headers a route sets or removes on the way upstream (`routes[].upstream_headers`), SPEC §10, §12.

Part of the settings model (settings.py); every file and secret named here is read while the
settings are validated, so that a missing one stops the start with the field's name.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from idemproxy import constants as c
from idemproxy.redact import redact_url

_STRICT = ConfigDict(extra="forbid", frozen=True)
# RFC 9110 §5.1: a field name is a token.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# RFC 9110 §5.5: visible ASCII, SP, HTAB and obs-text; nothing that could end the line.
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
# Headers the proxy frames, answers or speaks itself (SPEC §10, §4): a route may neither set nor
# remove them. Hop-by-hop headers never cross the proxy (RFC 9110 §7.6.1); `Expect` was answered
# by this proxy; the `Idempotency-*` headers it adds carry its own job and attempt, and one set
# by a route would give the backend another job's id, or a replay marker it never made. The
# client's `Idempotency-Key` is its intent: one value set for every client would make the owners
# collide at a backend that deduplicates on it (the configured key headers: `key_headers_kept`).
PROXY_HEADERS = frozenset(
    {
        *c.HOP_BY_HOP_HEADERS,
        "host",
        "content-length",
        "expect",
        *(
            name.lower()
            for name in (
                c.DEFAULT_KEY_HEADER,
                c.JOB_HEADER,
                c.ATTEMPT_HEADER,
                c.REPLAYED_HEADER,
                c.REPLAY_OMITTED_HEADER,
                c.ERROR_HEADER,
            )
        ),
    }
)
# `env:NAME` or `file:PATH`, after words kept as they are (an auth scheme: `Bearer env:KEY`).
_READ_FROM = re.compile(r"((?:[^ ]+ )*)((?:env|file):\S.*)")
# `env:` or `file:` starting a word anywhere else: a value that looks read from a source but is
# not in the form above (two spaces, a tab, nothing after the colon) is refused, never sent as
# it is: the literal `file:/run/secrets/key` would go upstream in place of the secret.
_LOOKS_READ = re.compile(r"(?:^|\s)(?:env|file):")
NO_PROXY = "none"  # `proxy: none`: this upstream is reached directly, whatever else is set


class UpstreamTlsSettings(BaseModel):
    """TLS to one upstream, as nginx's `proxy_ssl_*` and Envoy's upstream TLS context."""

    model_config = _STRICT
    # PEM bundle of the CAs trusted for this upstream, instead of the system's store.
    ca_file: Path | None = None
    # PEM client certificate (mTLS); `key_file` is its private key unless the file holds both.
    cert_file: Path | None = None
    key_file: Path | None = None
    # The name sent as SNI and checked against the certificate, instead of the URL's host.
    server_name: str | None = None
    # False trusts any certificate: for a test bench only (logged as a warning at start-up).
    verify: bool = True

    @field_validator("ca_file", "cert_file", "key_file")
    @classmethod
    def _readable(cls, path: Path | None) -> Path | None:
        if path is not None:
            _check_readable(path)
        return path

    @field_validator("server_name")
    @classmethod
    def _a_name(cls, name: str | None) -> str | None:
        if name is not None and (not name or any(ch in name for ch in "/:@ \t")):
            raise ValueError("must be a host name (or an IP address), without a port")
        return name

    @model_validator(mode="after")
    def _key_needs_a_cert(self) -> UpstreamTlsSettings:
        if self.key_file is not None and self.cert_file is None:
            raise ValueError("key_file needs cert_file (the client certificate it belongs to)")
        return self


_NO_TLS = UpstreamTlsSettings()


class UpstreamHeaderSettings(BaseModel):
    """Headers a route changes on the way upstream (after the owner and fingerprint were taken
    from the client's request, SPEC §5, §6): `remove` first, then `set`.

    A `set` value is `env:NAME` (an environment variable), `file:PATH` (a file's content, without
    its final line break), or the value itself; words before `env:` or `file:` are kept as they
    are (`Bearer env:OPENAI_API_KEY`), one space apart; a value with a word starting `env:` or
    `file:` in any other form (two spaces, a tab) is refused. Secrets belong in the first two:
    the values read are never logged, stored or part of the fingerprint.
    """

    model_config = ConfigDict(extra="forbid")
    set: dict[str, str] = Field(default_factory=dict)
    remove: list[str] = Field(default_factory=list)
    _values: tuple[tuple[str, str], ...] = PrivateAttr(default=())

    @field_validator("set")
    @classmethod
    def _set_names(cls, headers: dict[str, str]) -> dict[str, str]:
        for name in headers:
            _check_name(name)
        lowered = [name.lower() for name in headers]
        if len(set(lowered)) != len(lowered):
            raise ValueError("a header is set twice (names are case-insensitive)")
        return headers

    @field_validator("remove")
    @classmethod
    def _remove_names(cls, names: list[str]) -> list[str]:
        for name in names:
            _check_name(name)
        return names

    @model_validator(mode="after")
    def _read_values(self) -> UpstreamHeaderSettings:
        self._values = tuple(
            (name, _header_value(name, source)) for name, source in self.set.items()
        )
        return self

    @property
    def values(self) -> tuple[tuple[str, str], ...]:
        """The headers to set, their values read (at start-up, once)."""
        return self._values


class UpstreamSettings(BaseModel):
    """What one upstream (an origin: scheme, host and port) is reached with."""

    model_config = _STRICT
    tls: UpstreamTlsSettings = Field(default_factory=UpstreamTlsSettings)
    # http://[user:password@]host:port of a forward proxy for this upstream, or `none` to reach
    # it directly; unset: `upstream_proxy`, then the environment (`upstream_proxy_from_env`).
    proxy: str | None = None
    # Headers set or removed on requests to this upstream, after the route's own: a provider's
    # API key, when a route's upstreams are different providers.
    headers: UpstreamHeaderSettings = Field(default_factory=UpstreamHeaderSettings)

    @field_validator("proxy")
    @classmethod
    def _proxy_url(cls, url: str | None) -> str | None:
        if url is None or url == NO_PROXY:
            return url
        return check_proxy_url(url)


def check_proxy_url(url: str) -> str:
    """`http://[user:password@]host[:port]`; never echoing the URL (it may hold a password)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises for a port that is no number
    except ValueError as exc:
        raise ValueError("the proxy's port (or IPv6 address in brackets) is malformed") from exc
    if parts.scheme != "http":
        raise ValueError("must be an http:// URL (TLS to the proxy itself is not supported)")
    if not parts.hostname:
        raise ValueError("names no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError("must be http://[user:password@]host:port, with no path")
    return url


def check_tls_applies(url: str, options: UpstreamSettings) -> None:
    """Refuses TLS settings on an http:// upstream: the request would go in plaintext while the
    operator believes it verified (a CA) or authenticated (a client certificate), SPEC §10."""
    if url.startswith("http://") and options.tls != _NO_TLS:
        raise ValueError(
            f"{redact_url(url)}: tls is set but the upstream is http://, where it never applies:"
            " make it https:// or remove tls"
        )


def origin_of(url: str) -> tuple[str, int, bool]:
    """(host, port, TLS) of an http(s) URL: how the upstream client names a connection's peer."""
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    return (parts.hostname or "", parts.port or (443 if tls else 80), tls)


def _check_readable(path: Path) -> None:
    try:
        with path.open("rb") as file:
            file.read(1)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _check_name(name: str) -> None:
    if not _TOKEN.fullmatch(name):
        raise ValueError(f"{name!r} is not a header name")
    if name.lower() in PROXY_HEADERS:
        raise ValueError(
            f"{name} is framed, answered or set by the proxy itself: a route may not change it"
            " (SPEC §10)"
        )


def key_headers_kept(headers: UpstreamHeaderSettings, key_headers: dict[str, str]) -> None:
    """Refuses a header of `headers` that is an idempotency key header (`key_headers`: lower-case
    name to the setting naming it): set upstream for every client, owners would collide at a
    backend that deduplicates on it; removed, it could not deduplicate (SPEC §10)."""
    for name in (*headers.set, *headers.remove):
        setting = key_headers.get(name.lower())
        if setting is not None:
            raise ValueError(
                f"{name} is the idempotency key header ({setting}): a route may not change it"
                " upstream (SPEC §10)"
            )


def read_value(name: str, setting: str) -> str:
    """The value `setting` (`env:NAME`, `file:PATH` or the value itself) stands for, as for
    `upstream_headers`; the error names `name` and the source, never the value read."""
    return _header_value(name, setting)


def _header_value(name: str, setting: str) -> str:
    """The value `setting` stands for; the error names the header and the source, never the
    value read."""
    found = _READ_FROM.fullmatch(setting)
    if found is None and _LOOKS_READ.search(setting):
        raise ValueError(
            f"{name}: env:NAME or file:PATH may follow words separated by single spaces"
            " (Bearer env:NAME), nothing else"
        )
    prefix, source = (found[1], found[2]) if found else ("", setting)
    if source.startswith("env:"):
        variable = source[4:]
        if not _ENV_NAME.fullmatch(variable):
            raise ValueError(f"{name}: env:NAME needs an environment variable name")
        value = os.environ.get(variable)
        if value is None:
            raise ValueError(f"{name}: environment variable {variable} is not set")
    elif source.startswith("file:"):
        path = Path(source[5:])
        try:
            value = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ValueError(f"{name}: cannot read {path}: {why or exc}") from exc
        # A secret file made with `echo` (or mounted from one) ends in a line break.
        value = value.removesuffix("\n").removesuffix("\r")
    else:
        value = source
    value = prefix + value.strip(" \t")
    if not value or not _FIELD_VALUE.fullmatch(value):
        raise ValueError(f"{name}: the value from {_what(source)} is empty or not a header value")
    return value


def _what(source: str) -> str:
    return source if source.startswith(("env:", "file:")) else "the setting"
