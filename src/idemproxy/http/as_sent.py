"""What the client sent, kept on a request that the proxy handles as another one.

An absolute-form target without a path (`GET http://host?q`) is handled as the same target with
its `/` (proxy/server/connection.py `routable`): a clone, whose target is its URL's text. A URL
holds no empty query (`http://host?` becomes `http://host/`), so the target goes upstream from
the one kept here (http/headers.py `outgoing`, SPEC §10: as sent).
"""

from __future__ import annotations

from aiohttp import web

TARGET_AS_SENT = web.RequestKey("target_as_sent", str)
