"""Fixtures for the proxy integration tests: the real proxy app in front of a real upstream.

`backend_url`, `ledger`, `make_proxy`, `proxy`, `jobs` and `raw_upstream` come from
tests/support/proxyapp.py, which says what each one is.
"""

from __future__ import annotations

from tests.support.proxyapp import (
    ProxyFactory,
    RawUpstream,
    ServeListener,
    Server,
    backend_url,
    jobs,
    ledger,
    make_proxy,
    proxy,
    raw_upstream,
)

__all__ = [
    "ProxyFactory",
    "RawUpstream",
    "ServeListener",
    "Server",
    "backend_url",
    "jobs",
    "ledger",
    "make_proxy",
    "proxy",
    "raw_upstream",
]
