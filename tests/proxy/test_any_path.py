"""The proxy's one route matches what `/{tail:.*}` matched, without a pattern."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request
from aiohttp.typedefs import Handler

from idemproxy.proxy.server.any_path import AnyPath, direct_handler


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


async def test_a_target_not_in_origin_form_is_not_matched() -> None:
    resource = AnyPath(_echo, expect_handler=_no_expect)
    request = make_mocked_request("OPTIONS", "*")
    assert await resource.resolve(request) == (None, set())
    matched, _ = await resource.resolve(make_mocked_request("GET", "/"))
    assert matched is not None


# --- direct_handler: Application._handle's work without the router ---------------------------


async def _refuse_expect(_request: web.Request) -> web.Response:
    return web.Response(status=417)


def _frozen(app: web.Application) -> web.Application:
    app.freeze()  # as the runner leaves it
    return app


async def test_the_direct_handler_answers_as_the_app_does_and_sets_the_app() -> None:
    app = _frozen(_app())
    handle = direct_handler(app)
    assert handle != app._handle
    for target in ("/", "/orders?x=1", "/%2F/encoded"):
        theirs = make_mocked_request("POST", target, app=app)
        ours = make_mocked_request("POST", target, app=app)
        expected = await app._handle(theirs)
        got = await handle(ours)
        assert isinstance(expected, web.Response)
        assert isinstance(got, web.Response)
        assert (got.status, got.text) == (expected.status, expected.text) == (200, f"POST {target}")
        assert ours.app is app
        assert ours.match_info.route is theirs.match_info.route


async def test_the_direct_handler_refuses_a_target_not_in_origin_form_as_the_router_does() -> None:
    app = _frozen(_app())
    with pytest.raises(web.HTTPNotFound):
        await app._handle(make_mocked_request("OPTIONS", "*", app=app))
    with pytest.raises(web.HTTPNotFound):
        await direct_handler(app)(make_mocked_request("OPTIONS", "*", app=app))


async def test_the_direct_handler_asks_the_expect_handler_first() -> None:
    refusing = web.Application()
    refusing.router.register_resource(AnyPath(_echo, expect_handler=_refuse_expect))
    expect = {"Expect": "100-continue"}
    refused = await direct_handler(_frozen(refusing))(
        make_mocked_request("POST", "/x", headers=expect, app=refusing)
    )
    assert refused.status == 417
    app = _frozen(_app())
    invited = await direct_handler(app)(make_mocked_request("POST", "/x", headers=expect, app=app))
    assert isinstance(invited, web.Response)
    assert (invited.status, invited.text) == (200, "POST /x")


@web.middleware
async def _passing(request: web.Request, handler: Handler) -> web.StreamResponse:
    return await handler(request)


def test_an_app_that_is_not_just_any_path_keeps_its_router() -> None:
    with_middleware = web.Application(middlewares=[_passing])
    with_middleware.router.register_resource(AnyPath(_echo, expect_handler=_no_expect))
    with_more = _app()
    with_more.router.add_get("/health", _echo)
    for app in (with_middleware, with_more):
        assert direct_handler(app) == app._handle


@pytest.mark.parametrize("target", ["http://h", "http://h?x=1", "https://h:8443"])
async def test_an_absolute_form_target_without_a_path_is_matched(target: str) -> None:
    """RFC 9112 §3.2.1: its empty path is `/`; the router answered 404."""
    resource = AnyPath(_echo, expect_handler=_no_expect)
    matched, _ = await resource.resolve(make_mocked_request("GET", target))
    assert matched is not None
    app = _frozen(_app())
    response = await direct_handler(app)(make_mocked_request("GET", target, app=app))
    assert isinstance(response, web.Response)
    assert (response.status, response.text) == (200, f"GET {target}")
