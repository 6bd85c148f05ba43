"""Credentials out of URLs and DSNs before they are printed or logged (SPEC §13).

A secret can sit in the userinfo (`postgresql://app:s3cret@db/idem`) or in the query: libpq takes
`?password=` and `?sslpassword=`, and other clients take tokens there. Every place that prints a
store DSN, a Redis URL or an upstream URL goes through `redact_url`.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit

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
    }
)


def redact_url(url: str) -> str:
    """`url` with the password of its userinfo and every secret query value masked."""
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unbalanced "[": nothing is trusted to be where it seems
        return _scheme_only(url)
    netloc = parts.netloc
    userinfo, at, host = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:{MASK}@{host}"
    query = redact_query(parts.query)
    if netloc == parts.netloc and query == parts.query:
        return url
    # Rebuilt by hand: geturl() drops an empty authority (sqlite:///path -> sqlite:/path).
    rebuilt = f"{parts.scheme}://{netloc}{parts.path}"
    rebuilt += f"?{query}" if query else ""
    return rebuilt + (f"#{parts.fragment}" if parts.fragment else "")


def redact_query(query: str) -> str:
    """A URL's query with the value of every secret-looking parameter masked."""
    if not query:
        return query
    pairs = parse_qsl(query, keep_blank_values=True)
    if not any(name.lower() in SECRET_PARAMETERS for name, _ in pairs):
        return query
    masked = [(n, MASK if n.lower() in SECRET_PARAMETERS else v) for n, v in pairs]
    return urlencode(masked, safe="*/:")


def _scheme_only(url: str) -> str:
    scheme, sep, _ = url.partition("://")
    return f"{scheme}{sep}{MASK}" if sep else MASK
