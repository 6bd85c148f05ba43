"""The proxy's one route: every method on every path, resolved without a pattern.

aiohttp matches `/{tail:.*}` with a regular expression and percent-decodes the captured tail
for every request, and the proxy never reads it (it forwards the raw target, SPEC §10). This
resource matches the same requests (an origin-form path, i.e. one that starts with "/"), an
absolute-form target without a path and `OPTIONS *`, and captures nothing: one match info per
request and no pattern.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler

from idemproxy.http.headers import asks_the_server, split_absolute_form

ExpectHandler = Callable[[web.Request], Awaitable[web.StreamResponse | None]]
_NOTHING: set[str] = set()


class AnyPath(web.PlainResource):
    """Indexed under "/", the last part aiohttp's resolver looks up for any path."""

    def __init__(self, handler: Handler, *, expect_handler: ExpectHandler) -> None:
        super().__init__("/")
        self.route = self.add_route(hdrs.METH_ANY, handler, expect_handler=expect_handler)

    async def resolve(
        self, request: web.Request
    ) -> tuple[web.UrlMappingMatchInfo | None, set[str]]:
        if not proxied(request):
            return None, _NOTHING  # as `/{tail:.*}` would not match it either
        return web.UrlMappingMatchInfo({}, self.route), _NOTHING

    def add_prefix(self, prefix: str) -> None:
        raise RuntimeError("the proxy's catch-all resource is not mounted under a prefix")

    def raw_match(self, path: str) -> bool:
        return False  # never merged with a resource added later by path


def proxied(request: web.Request) -> bool:
    """An origin-form target, or an absolute-form one (RFC 9112 §3.2.2), whose empty path is
    `/` (§3.2.1: `GET http://host?q` asks for `/?q`), or `OPTIONS *` (§3.2.4: the server as a
    whole, forwarded as it came); not an authority-form target."""
    path = request.rel_url.path_safe
    if path.startswith("/"):
        return True
    if not path:
        return split_absolute_form(request.raw_path) is not None
    return asks_the_server(request.method, request.raw_path)
