"""The proxy's one route matches what `/{tail:.*}` matched, without a pattern."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from idemproxy.proxy.any_path import AnyPath


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
