"""Credentials never leave the process in a printed DSN or URL (idemproxy/redact.py)."""

from __future__ import annotations

import pytest

from idemproxy.redact import redact_path, redact_query, redact_url

CASES = [
    ("postgresql://app:s3cret@db:5432/idem", "postgresql://app:***@db:5432/idem"),
    ("postgresql://app@db/idem?password=s3cret", "postgresql://app@db/idem?password=***"),
    (
        "postgresql://app@db/idem?sslmode=require&PassWord=a%40b&sslpassword=k&sslkey=/k.pem",
        "postgresql://app@db/idem?sslmode=require&PassWord=***&sslpassword=***&sslkey=/k.pem",
    ),
    ("postgresql:///idem?host=/run/pg&password=s", "postgresql:///idem?host=/run/pg&password=***"),
    ("postgresql://u:p@h1:5432,h2:5432/idem", "postgresql://u:***@h1:5432,h2:5432/idem"),
    ("postgresql://u:p:q@[::1]:5/db", "postgresql://u:***@[::1]:5/db"),
    ("redis://:s3cret@cache:6379/0", "redis://:***@cache:6379/0"),
    ("rediss://default:s3cret@cache:6380/0", "rediss://default:***@cache:6380/0"),
    ("http://svc:8000/v1?token=abc&x=1", "http://svc:8000/v1?token=***&x=1"),
    ("http://user:pw@host:3000/x", "http://user:***@host:3000/x"),
    # An API key as Basic auth's user name, with no password or an empty one (Stripe's form).
    ("https://sk_live_TOKEN@api.example.com/v1", "https://***@api.example.com/v1"),
    ("http://sk_live_KEY:@127.0.0.1:8080", "http://***@127.0.0.1:8080"),
    ("HTTPS://token@host", "https://***@host"),
    ("sqlite:///var/lib/idemproxy/idem.db", "sqlite:///var/lib/idemproxy/idem.db"),
    ("http://host:3000", "http://host:3000"),
    ("postgresql://u:p@[::1/db", "postgresql://***"),  # unparseable: nothing but the scheme
]


@pytest.mark.parametrize(("url", "shown"), CASES)
def test_every_credential_is_masked_and_the_rest_kept(url: str, shown: str) -> None:
    assert redact_url(url) == shown


QUERIES = [
    # Names a signed URL, OAuth or an API gateway uses for a credential.
    (
        "sig=S&client_secret=C&X-Amz-Signature=A&refresh_token=R&x-api-key=K&key=K2&page=2",
        "sig=***&client_secret=***&X-Amz-Signature=***&refresh_token=***&x-api-key=***"
        "&key=***&page=2",
    ),
    # `;` separates pairs for servers that take the HTML 4 separator.
    ("a=1;token=T&b=2", "a=1;token=***&b=2"),
    # A percent-encoded or repeated name is still the name.
    ("%74oken=E&token=1&token=2", "%74oken=***&token=***&token=***"),
    # Everything else is kept byte for byte, undecodable escapes included.
    ("y=%zz&q=a+b&flag", "y=%zz&q=a+b&flag"),
    ("sslkey=/k.pem&sslcert=/c.pem", "sslkey=/k.pem&sslcert=/c.pem"),
]


@pytest.mark.parametrize(("query", "shown"), QUERIES)
def test_every_secret_looking_query_value_is_masked(query: str, shown: str) -> None:
    assert redact_query(query) == shown


@pytest.mark.parametrize(
    ("path", "shown"),
    [
        ("/pay;jsessionid=SECRET", "/pay;jsessionid=***"),
        ("/a;PHPSESSID=x/b;token=y;v=1", "/a;PHPSESSID=***/b;token=***;v=1"),
        ("/a;v=1/b", "/a;v=1/b"),
        ("/plain/path", "/plain/path"),
        ("/a;sid", "/a;sid"),  # a name without a value shows nothing secret
        ("/a;sid=x", "/a;sid=***"),
        ("/a;side=x", "/a;side=x"),
        ("/(S(sessionvalue))/pay", "/(S(***))/pay"),  # ASP.NET cookieless
        ("/(A(anon)S(sess)F(ticket))/p", "/(A(***)S(***)F(***))/p"),
        ("/docs/(draft)/p", "/docs/(draft)/p"),
        # Percent-encoded separators and parentheses count as the characters.
        ("/r%3Bjsessionid=S", "/r%3Bjsessionid=***"),
        ("/r;jsessionid%3DS", "/r;jsessionid%3D***"),
        ("/%28S%28value%29%29/p", "/(S(***))/p"),
        ("/a%20b/c", "/a%20b/c"),
        ("/a;jsessionid%3DS1=S2", "/a;jsessionid%3D***"),  # the first `=`, encoded or not
        ("/(S(S17%2F1))/p", "/(S(***))/p"),
    ],
)
def test_a_secret_path_parameter_is_masked(path: str, shown: str) -> None:
    assert redact_path(path) == shown
