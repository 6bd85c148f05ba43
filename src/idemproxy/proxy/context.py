"""Everything a request handler needs, built once from the settings and injected."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from idemproxy.config.settings import Settings
from idemproxy.core.decision import Policy
from idemproxy.core.machine import StatusPolicy
from idemproxy.core.quota import QuotaLimits
from idemproxy.http.offload import Offload
from idemproxy.identity.intent import OwnerPolicy
from idemproxy.observe.metrics import Metrics
from idemproxy.proxy.background.unsent import UnsentClaims
from idemproxy.proxy.background.unwritten import UnwrittenOutcomes
from idemproxy.proxy.failpoints import Failpoints
from idemproxy.proxy.idp.policy import build_owner_policy
from idemproxy.proxy.routing import RouteTable
from idemproxy.proxy.server.capture import ResponseBudget
from idemproxy.proxy.server.replay import SharedBodies
from idemproxy.proxy.upstream.client import UpstreamClient
from idemproxy.store.ports import JobStore

if TYPE_CHECKING:  # imported only when tracing is on (the optional extra `idemproxy[otel]`)
    from idemproxy.proxy.background.reconcile import Reconciler
    from idemproxy.proxy.tracing import Tracing


@dataclass(frozen=True, slots=True)
class Services:
    """What the process gives every context it builds, injected so that tests pass their own:
    the owner policy, when not given, is built from `settings.owner` (identity/intent.py), and
    no tracing means none."""

    failpoints: Failpoints | None = None
    metrics: Metrics | None = None
    owner: OwnerPolicy | None = None
    tracing: Tracing | None = None


@dataclass(slots=True)
class RequestsInFlight:
    """How many requests the handler is answering now: it counts them, a drain waits for
    them."""

    now: int = 0


@dataclass(slots=True)
class ProxyContext:
    settings: Settings
    # The hot path: the replay caches and the seal in front of the store of record.
    store: JobStore
    upstream: UpstreamClient
    routes: RouteTable
    policy: Policy
    statuses: StatusPolicy
    owner: OwnerPolicy
    governed_methods: frozenset[str]
    failpoints: Failpoints
    metrics: Metrics
    # Claims that failed (503, nothing forwarded) but may still commit: released when they do.
    unsent: UnsentClaims
    # Attempt outcomes the store could not take (503 after forwarding): written when it answers.
    unwritten: UnwrittenOutcomes
    # Response bytes held in memory, for this process (proxy/server/capture.py).
    budget: ResponseBudget
    # Large stored bodies being replayed, one copy per job (proxy/server/replay.py).
    replays: SharedBodies
    # Where a request body's key and fingerprint are worked out (http/offload.py).
    offload: Offload
    # Attempts run in tasks of their own so that a client hanging up cannot cancel the upstream
    # call or the completion write (SPEC §2); shutdown waits for them.
    attempts: set[asyncio.Task[Any]] = field(default_factory=set)
    # Requests being handled right now, counted by the handler, for the graceful drain
    # (proxy/drain.py).
    in_flight: RequestsInFlight = field(default_factory=RequestsInFlight)
    # A graceful shutdown began: no new claims, held duplicates answer (proxy/drain.py).
    draining: bool = False
    drained: bool = False
    # OpenTelemetry spans (proxy/tracing.py); None when `tracing.enabled` is off.
    tracing: Tracing | None = None
    # SPEC §7.1: the status lookup's header; None when it is off.
    status_header: str | None = None
    # SPEC §9: the limits per owner; None when no quota is set (claims stay one statement).
    quotas: QuotaLimits | None = None
    # SPEC §3.6: asks about unknown jobs (proxy/background/reconcile.py), once housekeeping
    # started it; None without a route that names a reconcile endpoint.
    reconciler: Reconciler | None = None

    @classmethod
    def build(
        cls,
        settings: Settings,
        store: JobStore,
        upstream: UpstreamClient,
        services: Services | None = None,
    ) -> ProxyContext:
        """The context of one process; what `services` leaves out is made here."""
        services = services or Services()
        failpoints = services.failpoints or Failpoints(None)
        metrics = services.metrics or Metrics.for_settings(settings)
        owner, tracing = services.owner, services.tracing
        budget = _budget(settings, metrics)
        return cls(
            settings=settings,
            store=store,
            upstream=upstream,
            routes=RouteTable.from_settings(settings),
            policy=Policy(hold_in_flight=settings.profile == "default"),
            statuses=StatusPolicy(
                frozenset(settings.outcomes.release_statuses),
                frozenset(settings.outcomes.unknown_statuses),
            ),
            owner=owner if owner is not None else build_owner_policy(settings.owner),
            governed_methods=frozenset(settings.methods),
            failpoints=failpoints,
            metrics=metrics,
            unsent=UnsentClaims(store, metrics.unsent_outcome, lease=settings.lease),
            unwritten=UnwrittenOutcomes(
                store, metrics.unwritten_outcome, metrics.attempt_outcome, metrics.late_results
            ),
            budget=budget,
            replays=_replays(budget, metrics),
            offload=Offload(settings.server.parse_processes),
            tracing=tracing,
            status_header=settings.status_header,
            quotas=_quotas(settings),
        )


def _quotas(settings: Settings) -> QuotaLimits | None:
    quotas = settings.quotas
    limits = QuotaLimits(
        quotas.max_in_flight,
        quotas.max_new_per_second,
        quotas.max_stored_bytes,
        settings.max_stored_body,
    )
    return limits if limits.any else None


def _budget(settings: Settings, metrics: Metrics) -> ResponseBudget:
    limits = settings.limits
    budget = ResponseBudget(
        limits.response_buffer,
        wait=limits.response_buffer_wait,
        hold=limits.response_buffer_hold,
        overdrawn=metrics.response_buffer_overdrafts.inc,
    )
    metrics.response_buffer.set_function(lambda: budget.used)
    return budget


def _replays(budget: ResponseBudget, metrics: Metrics) -> SharedBodies:
    shared = SharedBodies(budget)
    metrics.replay_bodies.set_function(lambda: shared.size)
    return shared


CONTEXT = web.AppKey("idemproxy.context", ProxyContext)
