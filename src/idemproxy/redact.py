"""Credentials out of URLs and DSNs before they are printed or logged (SPEC §13).

A secret can sit in the userinfo (`postgresql://app:s3cret@db/idem`) or in the query: libpq takes
`?password=` and `?sslpassword=`, and other clients take tokens there. Every place that prints a
store DSN, a Redis URL or an upstream URL goes through `redact_url`.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, unquote_plus, urlsplit

MASK = "***"
# Query parameters whose value is a credential (compared lower-cased). `sslkey` and `sslcert`
# name files, not secrets, and stay readable.
SECRET_PARAMETERS = frozenset(
    {
        "password",
        "passwd",
        "pass",
        "pwd",
        "sslpassword",
        "secret",
        "token",
        "access_token",
        "auth",
        "auth_token",
        "authorization",
        "api_key",
        "apikey",
        "sig",
        "key",
        "code",
        "sid",  # a session id (whole name only: `side` and `inside` are no secrets)
    }
)
# Fragments of a secret parameter's name (compared lower-cased, `-` and `.` read as `_`).
_SECRET_FRAGMENTS = (
    "pass",
    "pwd",
    "secret",
    "token",
    "auth",
    "signature",
    "credential",
    "session",
    "sessid",  # PHPSESSID
    "api_key",
    "apikey",
    "private",
)
# Names of files, not secrets (libpq's): readable though they hold a fragment above or "key".
_READABLE_PARAMETERS = frozenset({"sslkey", "sslcert", "sslrootcert", "sslcrl", "sslcrldir"})
_QUERY_SEPARATORS = re.compile("[&;]")
# Schemes whose user name alone is often a credential (an API key sent as Basic auth's user,
# with an empty password); a store's or Redis's user name is a role, and stays readable.
_TOKEN_AS_USER = frozenset({"http", "https", "ws", "wss"})


def redact_url(url: str) -> str:
    """`url` with the password of its userinfo and every secret query value masked."""
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unbalanced "[": nothing is trusted to be where it seems
        return _scheme_only(url)
    netloc = parts.netloc
    userinfo, at, host = netloc.rpartition("@")
    user, colon, password = userinfo.partition(":")
    if at and parts.scheme.lower() in _TOKEN_AS_USER and not password:
        netloc = f"{MASK}@{host}"  # `https://sk_live_…@api` or `…:@`: the token is the user
    elif at and colon:
        netloc = f"{user}:{MASK}@{host}"
    query = redact_query(parts.query)
    if netloc == parts.netloc and query == parts.query:
        return url
    # Rebuilt by hand: geturl() drops an empty authority (sqlite:///path -> sqlite:/path).
    rebuilt = f"{parts.scheme}://{netloc}{parts.path}"
    rebuilt += f"?{query}" if query else ""
    return rebuilt + (f"#{parts.fragment}" if parts.fragment else "")


def redact_query(query: str) -> str:
    """A URL's query with the value of every secret-looking parameter masked.

    Pairs are split at `&` and at `;` (servers that still take the HTML 4 separator read
    `a=1;token=x` as two pairs), a name is compared percent-decoded, and every other byte of the
    query is kept as it came."""
    if not query:
        return query
    pieces = _QUERY_SEPARATORS.split(query)
    masked = [_masked(piece) for piece in pieces]
    if masked == pieces:
        return query
    separators = _QUERY_SEPARATORS.findall(query)
    out = [masked[0]]
    for separator, piece in zip(separators, masked[1:], strict=True):
        out += (separator, piece)
    return "".join(out)


def redact_path(path: str) -> str:
    """A path with the value of every secret-looking path parameter masked: a session id in a
    segment's `;name=value` (`/pay;jsessionid=…`, RFC 3986 §3.3) is as much a credential as in
    a query, and so is one in an ASP.NET cookieless segment (`/(S(…))/`, `(A(…))`, `(F(…))`).
    Every other byte is kept. (proxy/server/trace.py tests for the same three marks before
    it calls this.)"""
    if ";" not in path and "(" not in path and "%" not in path:
        return path
    return "/".join(_masked_segment(segment) for segment in path.split("/"))


def _masked_segment(segment: str) -> str:
    """One path segment, its secrets masked; a percent-encoded `;`, `=` or parenthesis counts
    as the character (a log line must not show what a server that decodes it reads)."""
    decoded = unquote(segment) if "%" in segment else segment
    if decoded.startswith("(") and _COOKIELESS.fullmatch(decoded):
        return _COOKIELESS_VALUE.sub(f"\\1({MASK})", decoded)
    if ";" not in segment and "%" not in segment:
        return segment
    pieces = _PARAMETER_SEPARATOR.split(segment)  # the head, then separator and parameter
    for index in range(2, len(pieces), 2):
        pieces[index] = _masked(pieces[index])
    return "".join(pieces)


_PARAMETER_SEPARATOR = re.compile("(;|%3[bB])")


# ASP.NET's cookieless session, anonymous id and forms ticket: one or more `X(value)` in
# parentheses, as a whole path segment.
_COOKIELESS = re.compile(r"\((?:[A-Za-z]\([^()]*\))+\)")
_COOKIELESS_VALUE = re.compile(r"([A-Za-z])\([^()]*\)")


def is_secret_parameter(name: str) -> bool:
    """A parameter whose value is a credential: a known name, or one containing a fragment of
    one (`client_secret`, `refresh_token`, `X-Amz-Signature`, `x-api-key`, `sig`)."""
    folded = name.strip().lower().replace("-", "_").replace(".", "_")
    if folded in _READABLE_PARAMETERS:
        return False
    return folded in SECRET_PARAMETERS or any(f in folded for f in _SECRET_FRAGMENTS)


def _masked(piece: str) -> str:
    raw_name, equals, _ = piece.partition("=")
    if "%" in raw_name:  # `name%3Dvalue`: an encoded `=` before any other ends the name too
        found = _ENCODED_EQUALS.search(raw_name)
        if found is not None:
            raw_name, equals = piece[: found.start()], found.group()
    if not is_secret_parameter(unquote_plus(raw_name)):
        return piece
    return f"{raw_name}{equals}{MASK}" if equals else piece


_ENCODED_EQUALS = re.compile("%3[dD]")


def _scheme_only(url: str) -> str:
    scheme, sep, _ = url.partition("://")
    return f"{scheme}{sep}{MASK}" if sep else MASK


def escaped(text: str) -> str:
    """`text` on one printable line: a control character or lone surrogate a peer sent (an
    upstream's or egress proxy's words) is written as Python writes it in a string literal
    (`\\r`, `\\x1b`, `\\udce9`), so it can neither forge a log line nor move a terminal's
    cursor, nor reach a store that refuses it (PostgreSQL text and NUL)."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)
