"""The proxy's one route matches what `/{tail:.*}` matched, without a pattern."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from idemproxy.http.headers import split_absolute_form
from idemproxy.proxy.server.any_path import AnyPath
from idemproxy.proxy.server.connection import routable


async def _echo(request: web.Request) -> web.Response:
    return web.Response(text=f"{request.method} {request.raw_path}")


async def _no_expect(_request: web.Request) -> None:
    return None


def _app() -> web.Application:
    app = web.Application()
    app.router.register_resource(AnyPath(_echo, expect_handler=_no_expect))
    return app


@pytest.mark.parametrize(
    ("method", "target"),
    [
        ("GET", "/"),
        ("POST", "/orders"),
        ("PATCH", "/a/b/c?x=1&y=%20"),
        ("DELETE", "/%2F/encoded"),
        ("PUT", "/double//slashes/"),
        ("QUERY", "/custom-method"),
    ],
)
async def test_every_method_and_path_reaches_the_handler_untouched(
    method: str, target: str
) -> None:
    async with TestClient(TestServer(_app())) as client:
        response = await client.request(method, target)
        assert response.status == 200
        assert await response.text() == f"{method} {target}"


@pytest.mark.parametrize("target", ["/", "/x", "/x/y?z"])
async def test_it_resolves_exactly_where_the_tail_pattern_did(target: str) -> None:
    pattern = web.Application()
    pattern.router.add_route("*", "/{tail:.*}", _echo)
    for app in (pattern, _app()):
        request = make_mocked_request("POST", target, app=app)
        match = await app.router.resolve(request)
        assert match.http_exception is None
        assert match.handler is _echo


async def test_an_authority_form_target_is_not_matched() -> None:
    resource = AnyPath(_echo, expect_handler=_no_expect)
    request = make_mocked_request("CONNECT", "proxy:443")
    assert await resource.resolve(request) == (None, set())
    matched, _ = await resource.resolve(make_mocked_request("GET", "/"))
    assert matched is not None


async def test_options_asterisk_is_matched() -> None:
    """RFC 9112 §3.2.4: a question to the server as a whole, forwarded as `*` (SPEC §10)."""
    resource = AnyPath(_echo, expect_handler=_no_expect)
    matched, _ = await resource.resolve(make_mocked_request("OPTIONS", "*"))
    assert matched is not None


@pytest.mark.parametrize("target", ["http://h", "http://h?x=1", "https://h:8443"])
async def test_an_absolute_form_target_without_a_path_is_matched(target: str) -> None:
    """RFC 9112 §3.2.1: its empty path is `/`; aiohttp's router alone answers 404, so the
    listener routes it with its `/` (`routable`)."""
    resource = AnyPath(_echo, expect_handler=_no_expect)
    matched, _ = await resource.resolve(make_mocked_request("GET", target))
    assert matched is not None
    app = _app()
    routed = routable(make_mocked_request("GET", target, app=app))
    assert isinstance(routed, web.Request)
    assert split_absolute_form(routed.raw_path) == split_absolute_form(target)
    match = await app.router.resolve(routed)
    assert match.http_exception is None
    assert match.handler is _echo


@pytest.mark.parametrize("target", ["/x", "http://h/x", "*"])
def test_other_targets_are_routed_as_they_came(target: str) -> None:
    request = make_mocked_request("GET", target)
    assert routable(request) is request


async def test_the_expect_handler_is_the_routes() -> None:
    """aiohttp asks it before the handler (`Expect: 100-continue`, proxy/handler.py)."""
    resource = AnyPath(_echo, expect_handler=_refuse_expect)
    request = make_mocked_request("POST", "/x", headers={"Expect": "100-continue"})
    response = await resource.route.handle_expect_header(request)
    assert response is not None
    assert response.status == 417


async def _refuse_expect(_request: web.Request) -> web.Response:
    return web.Response(status=417)
