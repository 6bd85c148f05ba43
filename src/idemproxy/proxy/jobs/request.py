"""One governed request, as the job loop, the attempts and the race all see it (SPEC §2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from aiohttp import web

from idemproxy.core.types import Intent
from idemproxy.proxy.routing import Route
from idemproxy.proxy.server.connection import RequestBody
from idemproxy.proxy.server.trace import Trace


class OwnerTransition(NamedTuple):
    """The two owners of a request in the transition to a pepper (SPEC §5)."""

    owner: str  # peppered: new jobs are claimed under it
    legacy: str  # plain SHA-256: a job under it is the request's job


@dataclass(slots=True)
class GovernedRequest:
    """Built once by the handler, after the request was identified (SPEC §2.1): what it is
    (`intent`, `body`), where it goes (`route`), the client's connection (`request`) and what
    is recorded about it (`trace`, which the loop fills in). The process's collaborators are
    not in it: the driver was given them when it was built.

    Nothing assigns to it once built. It is not frozen because a frozen dataclass sets each
    field through `object.__setattr__`, about ten times the cost of this one's `__init__`, on
    every governed request (bench/findings.md measured the same for jobs)."""

    request: web.Request
    route: Route
    intent: Intent
    body: RequestBody
    trace: Trace
    # SPEC §5, `owner.legacy_owners`: the request's peppered owner and the one its credential
    # had before `owner.pepper`, under which its job may be (proxy/jobs/governed.py). None
    # outside the transition.
    transition: OwnerTransition | None = None
