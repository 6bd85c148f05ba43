"""SPEC §3.6: which reconcile endpoint answers for an `unknown` job's attempt
(proxy/background/endpoints.py): the route the job took, matched as requests are routed over
every route; never a guess between routes for different hosts that declare differently; only
for an attempt on an upstream of the endpoint's own origin, and with only that upstream's
header edits."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from idemproxy.config.settings import load_settings
from idemproxy.proxy.background.endpoints import Endpoint, endpoints
from idemproxy.proxy.routing import RouteTable

U = "http://backend:8080"
F = "http://fallback:8080"  # another origin
R = "http://reconciler:9000"  # another origin still


def reconciled(url: str = f"{U}/reconcile") -> dict[str, Any]:
    return {"reconcile": {"url": url}}


def route(prefix: str, upstream: str = U, **more: Any) -> dict[str, Any]:
    return {"prefix": prefix, "upstream": upstream, **more}


def test_the_longest_prefix_over_every_route_declared_or_not() -> None:
    known = endpoints(load_settings(routes=[route("/", resolve=reconciled()), route("/admin")]))
    assert known.for_job("/admin/x", U) is None
    assert known.for_job("/admin", U) is None
    assert not known.may_cover("/admin/x")
    asked = known.for_job("/payments?x=1", U)
    assert asked is not None and asked.prefix == "/"
    assert known.for_job("/administrator", U) is asked  # `/admin` takes `/admin/…` only


def test_routes_for_other_hosts_that_declare_otherwise_leave_it_unasked() -> None:
    routes = [route("/", resolve=reconciled()), route("/", host="admin.example")]
    assert endpoints(load_settings(routes=routes)).for_job("/x", U) is None
    # A longer prefix for one host does not hide the other hosts' catch-all.
    routes = [route("/pay", host="pay.example", resolve=reconciled()), route("/")]
    known = endpoints(load_settings(routes=routes))
    assert known.for_job("/pay/x", U) is None
    assert known.may_cover("/pay/x")  # cheap and loose: the attempt's read decides


def test_routes_that_declare_the_same_endpoint_are_no_ambiguity() -> None:
    routes = [
        route("/pay", host="pay.example", resolve=reconciled()),
        route("/pay", host="shop.example", resolve=reconciled()),
        route("/", resolve=reconciled()),
    ]
    asked = endpoints(load_settings(routes=routes)).for_job("/pay/x", U)
    assert asked is not None and asked.reconcile.url == f"{U}/reconcile"


def test_the_upstream_an_attempt_went_to_tells_routes_apart() -> None:
    routes = [route("/pay", host="pay.example", resolve=reconciled()), route("/", upstream=F)]
    known = endpoints(load_settings(routes=routes))
    asked = known.for_job("/pay/x", U)
    assert asked is not None and asked.prefix == "/pay"
    assert known.for_job("/pay/x", F) is None


def test_two_routes_with_one_prefix_and_host_are_refused_whichever_declares_a_way() -> None:
    """The second would never be used, its way of resolving neither (config/settings.py)."""
    for routes in (
        [route("/pay"), route("/pay", resolve=reconciled())],
        [route("/pay", resolve=reconciled()), route("/pay")],
    ):
        with pytest.raises(ValidationError, match="would never be used"):
            load_settings(routes=routes)


def test_an_endpoint_vouches_only_for_upstreams_of_its_own_origin() -> None:
    routes = [route("/pay", fallbacks=[F, f"{U}/v2"], resolve=reconciled("http://BACKEND:8080/r"))]
    (asked,) = endpoints(load_settings(routes=routes)).declared
    assert asked.upstreams == {U, f"{U}/v2"}
    assert asked.vouches_for(U) and not asked.vouches_for(F)
    elsewhere = [route("/pay", fallbacks=[F], resolve=reconciled(f"{R}/reconcile"))]
    (separate,) = endpoints(load_settings(routes=elsewhere)).declared
    assert separate.upstreams == frozenset()


def test_a_question_carries_only_the_header_edits_of_its_origin() -> None:
    routes = [
        route(
            "/pay",
            fallbacks=[F],
            upstream_headers={"set": {"X-Route": "r"}},
            resolve=reconciled(),
        )
    ]
    upstreams = {U: {"headers": {"set": {"X-U": "u"}}}, F: {"headers": {"set": {"X-F": "f"}}}}
    settings = load_settings(routes=routes, upstreams=upstreams)
    (asked,) = endpoints(settings).declared
    assert set(asked.edits) == {U}
    elsewhere = load_settings(
        routes=[{**routes[0], "resolve": reconciled(f"{R}/reconcile")}], upstreams=upstreams
    )
    assert dict(endpoints(elsewhere).declared[0].edits) == {}


def test_a_retry_asks_at_the_endpoint_of_the_route_it_took() -> None:
    routes = [route("/", resolve=reconciled()), route("/admin", fallbacks=[F])]
    table = RouteTable.from_settings(load_settings(routes=routes))
    admin, root = table.find("/admin/x", None), table.find("/x", None)
    assert admin is not None and root is not None
    assert Endpoint.of_route(admin) is None
    asked = Endpoint.of_route(root)
    assert asked is not None and asked == endpoints(load_settings(routes=routes)).declared[0]
