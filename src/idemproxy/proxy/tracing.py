"""OpenTelemetry traces of the proxy's requests (docs/operations.md, Tracing).

The only module that imports opentelemetry, the optional extra `idemproxy[otel]`; it is imported
only when `tracing.enabled` is set (proxy/app.py, `tracing_from_settings`). With tracing off the
governed path's observers (`JobObserver`, `AttemptObserver`) hand each step back as it is, and
the other hooks are a single `if ctx.tracing is not None` each: no span, no context and no
`traceparent` is made, and the upstream gets exactly the bytes it got without tracing.

The spans of a request (W3C Trace Context continues the client's `traceparent`):

    {method}                    server span, the whole request
      idemproxy.claim           the claim of its key (SPEC §2.2)
      idemproxy.hold            a duplicate waiting for the attempt in flight (SPEC §2.3)
      {method}                  client span, one per upstream attempt; `traceparent` goes upstream
        idemproxy.complete      the completion write (SPEC §1) or
        idemproxy.settle        the failed or unknown outcome written
      idemproxy.replay          the stored answer sent again (SPEC §2.4)

Attributes follow the HTTP semantic conventions (`http.request.method`, `url.path`,
`server.address`, `http.response.status_code`, `error.type`) plus the proxy's own under
`idemproxy.*`: job id, attempt number, outcome, replayed, a prefix of the owner hash and the
problem code. Never a body, a header value, a query string or a key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from aiohttp import web
from multidict import CIMultiDict
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import get_global_textmap
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace import Span, SpanKind, StatusCode
from opentelemetry.util.types import AttributeValue
from yarl import URL

from idemproxy import __version__
from idemproxy.constants import ANONYMOUS_OWNER, ERROR_HEADER
from idemproxy.core.machine import Outcome
from idemproxy.core.types import Claimed, ClaimResult, Job, JobState
from idemproxy.errors import ConfigError, ProblemError
from idemproxy.http.headers import CURRENT, traced
from idemproxy.proxy.server.trace import Trace
from idemproxy.redact import redact_path

log = logging.getLogger(__name__)
T = TypeVar("T")


class HandedBack(Protocol):
    """An attempt that ended without a result and left its job to the next one (`HandedBack`,
    proxy/jobs/jobrun.py)."""

    @property
    def outcome(self) -> Outcome: ...
    @property
    def status(self) -> int | None: ...
    @property
    def error(self) -> str | None: ...
    @property
    def problem(self) -> type[ProblemError]: ...


# What an attempt ends with (`Step`, proxy/jobs/jobrun.py): the client's response, a hand-back,
# or None when another attempt completed the job first.
Attempted = TypeVar("Attempted", bound="web.StreamResponse | HandedBack | None")
Attributes = dict[str, AttributeValue]

SERVICE = "idemproxy"
JOB_ID = "idemproxy.job.id"
ATTEMPT = "idemproxy.attempt"
OUTCOME = "idemproxy.outcome"
REPLAYED = "idemproxy.replayed"
OWNER = "idemproxy.owner"
PROBLEM = "idemproxy.problem"
_OWNER_PREFIX = 8  # as the request log line (proxy/server/trace.py)
# RFC 9110 §9: a span name is the method only when it is one of these (HTTP semconv: else HTTP).
_KNOWN_METHODS = frozenset(
    ("CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "TRACE")
)
_PROTOCOLS = ("http/protobuf", "grpc")
# The W3C Trace Context fields (`traceparent`, `tracestate`): the proxy's, once it traces.
_TRACE_CONTEXT_FIELDS = frozenset(("traceparent", "tracestate"))
_MAX_PORT = 65535
_PORT_DIGITS = 5


class Tracing:
    """One tracer provider per proxy process, and the spans the request path asks for."""

    def __init__(self, provider: TracerProvider, *, flush_timeout: float) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer(SERVICE, __version__)
        # OTEL_PROPAGATORS, by default W3C Trace Context and Baggage.
        self._propagator = get_global_textmap()
        self._flush_timeout = flush_timeout

    @classmethod
    def from_environment(cls, *, flush_timeout: float) -> Tracing:
        """Exporter, sampler and resource from the standard `OTEL_*` variables."""
        # Not at exit: the drain shuts it down with a bounded wait (`shutdown`).
        provider = TracerProvider(resource=service_resource(), shutdown_on_exit=False)
        for exporter in _exporters():
            provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider, flush_timeout=flush_timeout)

    @classmethod
    def exporting_to(cls, exporter: SpanExporter, *, flush_timeout: float = 5.0) -> Tracing:
        """Each span exported as it ends (tests, with the SDK's InMemorySpanExporter)."""
        provider = TracerProvider(resource=service_resource(), shutdown_on_exit=False)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return cls(provider, flush_timeout=flush_timeout)

    async def serve(
        self, request: web.Request, record: Trace, handling: Awaitable[web.StreamResponse]
    ) -> web.StreamResponse:
        """The server span of one request, continuing the client's trace."""
        parent = self._propagator.extract(request.headers)
        method = request.method
        span = self._tracer.start_span(
            method if method in _KNOWN_METHODS else "HTTP",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=_server_attributes(request),
        )
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        ids = span.get_span_context()
        if (correlation := traced(ids.trace_id, ids.span_id)) is not None:
            # Every log line of the request names its trace; the handler's reset ends it.
            CURRENT.set(correlation)
        try:
            response = await handling
        except BaseException as error:
            _errored(span, type(error).__qualname__)
            span.end()
            raise
        finally:
            otel_context.detach(token)
        _answered(span, record, response)
        span.end()
        return response

    async def claim(self, claiming: Awaitable[ClaimResult]) -> ClaimResult:
        with self._step("idemproxy.claim") as span:
            result = await _failing(span, claiming)
            span.set_attribute(JOB_ID, result.job.id)
            span.set_attribute("idemproxy.claimed", isinstance(result, Claimed))
            if isinstance(result, Claimed):
                span.set_attribute(ATTEMPT, result.attempt)
            return result

    async def hold(
        self, job_id: str, holding: Awaitable[tuple[T, Job | None]]
    ) -> tuple[T, Job | None]:
        """The span of a held duplicate's wait; `holding` gives what follows it and the job as
        read at its end (none when the key has none now)."""
        with self._step("idemproxy.hold", {JOB_ID: job_id}) as span:
            result = await _failing(span, holding)
            if (found := result[1]) is not None:
                span.set_attribute("idemproxy.job.state", found.state.value)
            return result

    def replay(self, job_id: str, status: int) -> None:
        """The stored answer goes out again: marked on the request's span and as a span."""
        trace.get_current_span().set_attribute(REPLAYED, True)
        attributes: Attributes = {JOB_ID: job_id, "http.response.status_code": status}
        self._tracer.start_span("idemproxy.replay", attributes=attributes).end()

    async def complete(self, job_id: str, attempt: int, completing: Awaitable[bool]) -> bool:
        with self._step("idemproxy.complete", {JOB_ID: job_id, ATTEMPT: attempt}) as span:
            won = await _failing(span, completing)
            # Lost: another attempt completed the job first, this result is discarded.
            span.set_attribute("idemproxy.won", won)
            return won

    async def settle(
        self, job_id: str, attempt: int, state: JobState, settling: Awaitable[bool]
    ) -> bool:
        attributes: Attributes = {
            JOB_ID: job_id,
            ATTEMPT: attempt,
            "idemproxy.job.state": state.value,
        }
        with self._step("idemproxy.settle", attributes) as span:
            won = await _failing(span, settling)
            span.set_attribute("idemproxy.won", won)
            return won

    async def attempt(
        self,
        method: str,
        url: URL,
        headers: CIMultiDict[str],
        ids: tuple[str, int],
        forwarding: Awaitable[Attempted],
    ) -> Attempted:
        """The client span of one upstream attempt; its `traceparent` goes upstream in `headers`
        (not yet sent: `forwarding` has not started)."""
        job_id, number = ids
        attributes = _client_attributes(method, url)
        attributes[JOB_ID], attributes[ATTEMPT] = job_id, number
        with self._client(method, attributes) as span:
            self._send_context(headers)
            step = await _failing(span, forwarding)
            _attempted(span, step)
            return step

    async def forward(
        self,
        method: str,
        url: URL,
        headers: CIMultiDict[str],
        forwarding: Awaitable[web.StreamResponse],
    ) -> web.StreamResponse:
        """The client span of a pass-through request (SPEC §2.5)."""
        with self._client(method, _client_attributes(method, url)) as span:
            self._send_context(headers)
            response = await _failing(span, forwarding)
            _client_answered(span, response)
            return response

    def upstream_failed(self, reason: str, outcome: Outcome | None = None) -> None:
        """On the client span: why the upstream gave no (whole) answer (connect failed,
        timeout, reset), and what that makes of a governed attempt."""
        span = trace.get_current_span()
        span.set_attribute("idemproxy.error", reason)
        if outcome is not None:
            span.set_attribute(OUTCOME, outcome.value)

    async def shutdown(self) -> None:
        """Export what is still queued, waiting at most `flush_timeout` (after the drain).

        The SDK's shutdown blocks (it joins the exporting thread, whose export may wait for a
        collector that is down): it runs in a thread of its own, a daemon one, so that neither
        the event loop nor the process's exit waits past the bound."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def shut_down() -> None:
            try:
                self._provider.shutdown()
            finally:
                # The loop may have gone on without it (the bound passed) and closed since.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_resolve, done)

        threading.Thread(target=shut_down, name="idemproxy-tracing-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(done, self._flush_timeout)
        except TimeoutError:
            log.warning(
                "tracing: spans still unexported after %.1fs at shutdown are dropped",
                self._flush_timeout,
            )

    def _send_context(self, headers: CIMultiDict[str]) -> None:
        """The current span's context into the headers going upstream, in place of the client's.

        The client's `tracestate` belongs to the client's `traceparent`: continued, the
        propagator writes it again; unparseable, the trace restarts here and W3C Trace Context
        §4.3 has it deleted, not sent along with a trace it never described."""
        for name in _TRACE_CONTEXT_FIELDS & self._propagator.fields:
            headers.popall(name, None)
        self._propagator.inject(headers)

    def _step(self, name: str, attributes: Attributes | None = None) -> _SpanScope:
        return _SpanScope(
            self._tracer.start_span(name, kind=SpanKind.INTERNAL, attributes=attributes)
        )

    def _client(self, method: str, attributes: Attributes) -> _SpanScope:
        name = method if method in _KNOWN_METHODS else "HTTP"
        return _SpanScope(
            self._tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes)
        )


class _SpanScope:
    """`span` is the current one (the parent of those started inside) until the block ends,
    and it ends with it."""

    __slots__ = ("_span", "_token")

    def __init__(self, span: Span) -> None:
        self._span = span
        self._token: object = None

    def __enter__(self) -> Span:
        self._token = otel_context.attach(trace.set_span_in_context(self._span))
        return self._span

    def __exit__(self, *_exc: object) -> None:
        otel_context.detach(self._token)  # type: ignore[arg-type]
        self._span.end()


async def _failing(span: Span, awaiting: Awaitable[T]) -> T:
    """`awaiting`'s result; an exception marks `span` as failed (the problem code when it is
    one of the proxy's answers) and goes on."""
    try:
        return await awaiting
    except ProblemError as error:
        span.set_attribute(PROBLEM, error.code)
        _errored(span, error.code)
        raise
    except asyncio.CancelledError:
        _errored(span, "cancelled")
        raise
    except Exception as error:
        _errored(span, type(error).__qualname__)
        raise


def _errored(span: Span, error_type: str) -> None:
    span.set_attribute("error.type", error_type)
    span.set_status(StatusCode.ERROR)


def _server_attributes(request: web.Request) -> Attributes:
    attributes: Attributes = {
        "http.request.method": request.method,
        # Never the query string, and no session id of the path (SPEC §13): they are secrets.
        "url.path": redact_path(request.rel_url.raw_path),  # as the log line shows it
        "url.scheme": request.scheme,
        "network.protocol.version": f"{request.version.major}.{request.version.minor}",
    }
    host, _, port = request.host.rpartition(":")
    # The Host header is the client's: only an ASCII port within RFC 793's range is a port
    # (`"²".isdigit()` holds but int() refuses it; a huge one overflows OTLP's int64).
    if host and _is_port(port) and not request.host.endswith("]"):
        attributes["server.address"], attributes["server.port"] = host.strip("[]"), int(port)
    else:
        attributes["server.address"] = request.host.strip("[]")
    if request.remote:
        attributes["client.address"] = request.remote
    return attributes


def _is_port(text: str) -> bool:
    return (
        0 < len(text) <= _PORT_DIGITS
        and text.isascii()
        and text.isdigit()
        and int(text) <= _MAX_PORT
    )


def _answered(span: Span, record: Trace, response: web.StreamResponse) -> None:
    status = response.status
    span.set_attribute("http.response.status_code", status)
    span.set_attribute(OUTCOME, str(record.outcome))
    if record.job_id is not None:
        span.set_attribute(JOB_ID, record.job_id)
    if record.attempt is not None:
        span.set_attribute(ATTEMPT, record.attempt)
    if record.owner is not None:
        span.set_attribute(OWNER, owner_label(record.owner))
    problem = response.headers.get(ERROR_HEADER)
    if problem is not None:
        span.set_attribute(PROBLEM, problem)
    if status >= 500:  # HTTP semconv: a server's 4xx is the client's error, not its own
        _errored(span, problem or str(status))


def owner_label(owner: str) -> str:
    """A prefix of the owner hash: enough to tell owners apart, never the credential."""
    return owner if owner == ANONYMOUS_OWNER else owner[:_OWNER_PREFIX]


def _client_attributes(method: str, url: URL) -> Attributes:
    # Neither the query (it may carry secrets) nor userinfo of the upstream URL.
    full = f"{url.scheme}://{url.raw_host}:{url.port}{redact_path(url.raw_path)}"
    attributes: Attributes = {"http.request.method": method, "url.full": full}
    if url.raw_host is not None:
        attributes["server.address"] = url.raw_host
    if url.port is not None:
        attributes["server.port"] = url.port
    return attributes


def _attempted(span: Span, step: web.StreamResponse | HandedBack | None) -> None:
    if step is None:  # another attempt completed the job first: this result was discarded
        span.set_attribute("idemproxy.won", False)
        return
    if isinstance(step, web.StreamResponse):
        _client_answered(span, step)
        return
    # Handed back: the next upstream, or another racer, answers.
    span.set_attribute(OUTCOME, step.outcome.value)
    if step.status is not None:
        span.set_attribute("http.response.status_code", step.status)
        _errored(span, str(step.status))
    else:
        span.set_attribute(PROBLEM, step.problem.code)
        _errored(span, step.problem.code)
    if step.error is not None:
        span.set_attribute("idemproxy.error", step.error)


def _client_answered(span: Span, response: web.StreamResponse) -> None:
    problem = response.headers.get(ERROR_HEADER)
    if problem is not None:  # the proxy's own answer: the upstream gave none it could use
        span.set_attribute(PROBLEM, problem)
        _errored(span, problem)
        return
    status = response.status
    span.set_attribute("http.response.status_code", status)
    if status >= 400:  # HTTP semconv: for a client, 4xx and 5xx are errors
        _errored(span, str(status))


def _resolve(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


def service_resource() -> Resource:
    """OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME, with `service.name` idemproxy and this
    version unless they say otherwise."""
    resource = Resource.create()
    detected = resource.attributes
    own: Attributes = {}
    if str(detected.get(SERVICE_NAME, "")).startswith("unknown_service"):
        own[SERVICE_NAME] = SERVICE
    if SERVICE_VERSION not in detected:
        own[SERVICE_VERSION] = __version__
    return resource.merge(Resource(own))


def _exporters() -> list[SpanExporter]:
    """OTEL_TRACES_EXPORTER: `otlp` (the default), `console`, `none`, or a comma list."""
    names = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower()
    exporters: list[SpanExporter] = []
    for name in (part.strip() for part in names.split(",")):
        if name in ("", "none"):
            continue
        if name == "otlp":
            exporters.append(_otlp())
        elif name == "console":
            exporters.append(ConsoleSpanExporter())
        else:
            raise ConfigError(
                f"OTEL_TRACES_EXPORTER: unknown exporter {name!r}; use otlp, console or none"
            )
    return exporters


def _otlp() -> SpanExporter:
    """OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL; http/protobuf by default, as the OpenTelemetry
    specification says. The exporter reads its endpoint, headers, timeout, compression and TLS
    files from the OTEL_EXPORTER_OTLP_* variables itself."""
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol not in _PROTOCOLS:
        raise ConfigError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not supported; use "
            + " or ".join(_PROTOCOLS)
        )
    try:
        return _OTLP_EXPORTERS[protocol]()
    except ImportError as exc:
        raise ConfigError(
            f"tracing: the OTLP {protocol} exporter is not installed: pip install 'idemproxy[otel]'"
        ) from exc


def _otlp_http() -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def _otlp_grpc() -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


_OTLP_EXPORTERS: dict[str, Callable[[], SpanExporter]] = {
    "http/protobuf": _otlp_http,
    "grpc": _otlp_grpc,
}
