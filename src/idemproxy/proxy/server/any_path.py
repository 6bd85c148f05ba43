"""The proxy's one route: every method on every path, resolved without a pattern.

aiohttp matches `/{tail:.*}` with a regular expression and percent-decodes the captured tail
for every request, and the proxy never reads it (it forwards the raw target, SPEC §10). This
resource matches the same requests (an origin-form path, i.e. one that starts with "/"), and an
absolute-form target without a path, and captures nothing.

`direct_handler` goes one step further for the listener of `idemproxy serve`: for an app whose
only resource is this one, it does what `Application._handle` does without asking the router,
whose lookup, match-info object and freezing cost every request about 10,000 instructions
(bench/compare). One frozen match info serves every request: it captures nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler
from aiohttp.web_urldispatcher import (
    AbstractResource,
    AbstractRoute,
    ResourceRoute,
    UrlMappingMatchInfo,
    _ExpectHandler,
    _InfoDict,
    _Resolve,
)
from yarl import URL

from idemproxy.http.host import split_absolute_form

_NOTHING: set[str] = set()


class AnyPath(AbstractResource):
    def __init__(self, handler: Handler, *, expect_handler: _ExpectHandler) -> None:
        super().__init__()
        self._route = ResourceRoute(hdrs.METH_ANY, handler, self, expect_handler=expect_handler)

    @property
    def canonical(self) -> str:
        return "/"  # indexed under "/", the last part aiohttp's resolver looks up for any path

    def url_for(self, **kwargs: str) -> URL:
        raise RuntimeError("the proxy's catch-all resource builds no URLs")

    async def resolve(self, request: web.Request) -> _Resolve:
        if not proxied(request):
            return None, _NOTHING  # as `/{tail:.*}` would not match it either
        return UrlMappingMatchInfo({}, self._route), _NOTHING

    def add_prefix(self, prefix: str) -> None:
        raise RuntimeError("the proxy's catch-all resource is not mounted under a prefix")

    def get_info(self) -> _InfoDict:
        return {"path": "/*"}

    def raw_match(self, path: str) -> bool:
        return False  # never merged with a resource added later by path

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Iterator[AbstractRoute]:
        yield self._route


RequestHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def proxied(request: web.Request) -> bool:
    """An origin-form target, or an absolute-form one (RFC 9112 §3.2.2), whose empty path is
    `/` (§3.2.1: `GET http://host?q` asks for `/?q`); not `*` nor an authority-form target."""
    path = request.rel_url.path_safe
    if path.startswith("/"):
        return True
    return not path and split_absolute_form(request.raw_path) is not None


def direct_handler(app: web.Application) -> RequestHandler:
    """`app._handle`'s work for requests that `AnyPath` matches, or `app._handle` itself when
    the app is not that simple (middlewares, other resources) or the path is not origin-form."""
    resources = list(app.router.resources())
    if app.middlewares or len(resources) != 1 or not isinstance(resources[0], AnyPath):
        return app._handle
    route = resources[0]._route
    match_info = UrlMappingMatchInfo({}, route)
    match_info.add_app(app)
    match_info.freeze()
    handler, routed = route.handler, app._handle

    async def handle(request: web.Request) -> web.StreamResponse:
        if not proxied(request):
            return await routed(request)  # the router's 404, as before
        request._match_info = match_info
        if request.headers.get(hdrs.EXPECT):  # as `Application._handle` answers `Expect`
            response = await route.handle_expect_header(request)
            await request.writer.drain()
            if response is not None:
                return response
        return await handler(request)

    return handle
