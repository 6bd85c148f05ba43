"""SPEC §3.6: a route's ways to resolve its unknown jobs, off unless declared."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from idemproxy.config.settings import RouteSettings

UPSTREAM = "http://payments:8080"


def route(**resolve: Any) -> RouteSettings:
    return RouteSettings.model_validate(
        {"prefix": "/payments", "upstream": UPSTREAM, "resolve": resolve}
    )


def test_off_by_default() -> None:
    settings = RouteSettings(upstream=UPSTREAM)
    assert settings.resolve.upstream_honours_key is None
    assert settings.resolve.reconcile is None


def test_both_ways_with_units() -> None:
    settings = route(
        upstream_honours_key={"window": "24h"},
        reconcile={"url": f"{UPSTREAM}/reconcile", "timeout": "2s", "backoff": "1s",
                   "max_backoff": "10m"},
    )  # fmt: skip
    assert settings.resolve.upstream_honours_key is not None
    assert settings.resolve.upstream_honours_key.window == 86400
    reconcile = settings.resolve.reconcile
    assert reconcile is not None
    assert (reconcile.timeout, reconcile.backoff, reconcile.max_backoff) == (2, 1, 600)


@pytest.mark.parametrize(
    "resolve",
    [
        {"upstream_honours_key": {}},  # a window must be declared
        {"upstream_honours_key": {"window": 0}},
        {"reconcile": {"url": "ftp://x/r"}},
        {"reconcile": {"url": "http:///r"}},
        {"reconcile": {"url": "http://user:secret@x/r"}},
        {"reconcile": {"url": "http://x/r", "backoff": "1m", "max_backoff": "1s"}},
        {"reconcile": {"url": "http://x/r", "timeout": 0}},
        {"reconcile": {"url": "http://x/r", "retries": 3}},
    ],
)
def test_refused(resolve: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="resolve"):
        route(**resolve)
