"""The request handler: route, identify (before any storage call), then govern or pass through.

Identifying a governed request (its bounded body, its intent; on a route with a key source or
webhooks, the signature and the key found in the body) and the status lookup are below it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass

from aiohttp import HttpVersion11, hdrs, web
from multidict import CIMultiDictProxy

from idemproxy.config.settings import Settings
from idemproxy.constants import ERROR_HEADER, HOP_BY_HOP_HEADERS
from idemproxy.core.states import EXPIRABLE
from idemproxy.core.types import Intent, Job, JobState
from idemproxy.errors import (
    BodyEncodingUnsupported,
    BodyInvalid,
    BodyTooLarge,
    ClientDisconnected,
    ExpectationFailed,
    HeaderInvalid,
    KeyAmbiguous,
    KeyInvalid,
    KeyMissing,
    KeyNotFound,
    NoRoute,
    OwnerMissing,
    OwnerUnstable,
    PathInvalid,
    ProblemError,
)
from idemproxy.http.codings import Undecodable, coding_names, decode
from idemproxy.http.headers import (
    CURRENT,
    asks_the_server,
    correlation_of,
    hop_by_hop,
    host_problem,
    valid_host,
)
from idemproxy.http.offload import OFF_LOOP_CONTAINERS, Offload, heavy, off_loop
from idemproxy.http.problems import problem_response
from idemproxy.identity.intent import (
    FingerprintedHead,
    OwnerPolicy,
    derive_owners,
    fingerprint,
    fingerprints,
    fingerprints_of_digest,
    headers_field,
    parse_key,
)
from idemproxy.identity.jwt_owner import UNVERIFIED, KeyNotLoaded
from idemproxy.identity.key_source import KeySource
from idemproxy.identity.webhooks import WebhookVerifier
from idemproxy.observe.metrics import DisconnectStage, RequestOutcome
from idemproxy.proxy.context import ProxyContext
from idemproxy.proxy.jobs.governed import Governor
from idemproxy.proxy.jobs.request import GovernedRequest, OwnerTransition
from idemproxy.proxy.passthrough import PassThrough
from idemproxy.proxy.routing import Route
from idemproxy.proxy.server.connection import (
    PROXY_ROUTE,
    HeadWriter,
    RequestBody,
    only_response,
    read_body,
)
from idemproxy.proxy.server.hangups import client_gone
from idemproxy.proxy.server.trace import Trace, record
from idemproxy.proxy.upstream.client import transfer_codings

# A governed request's body and intent, before any storage call (SPEC §2.1, §6).


def _head(request: web.Request, sent_headers: str | None) -> FingerprintedHead:
    """What of the request's head its fingerprint hashes; `sent_headers`: the field of
    `fingerprint_headers` (`Identify.sent_headers`)."""
    url, headers = request.rel_url, request.headers
    # Every field, in order (RFC 9110 §5.3: a list may be split over several).
    content_encoding = ",".join(headers.getall(hdrs.CONTENT_ENCODING, ()))
    return (
        request.method,
        url.raw_path,
        url.raw_query_string,
        headers.get(hdrs.CONTENT_TYPE),
        content_encoding,
        sent_headers,
    )


# Identifying a request on a route whose key has another source (SPEC §4.1) or that receives
# webhooks (SPEC §4.2): the signature is verified, and the key found, before any storage call.


def coded_body_key(source: KeySource, body: bytes, codings: list[str], limit: int) -> str | None:
    """SPEC §4.1: the key of a body sent with a content coding, read from the decoded JSON (the
    bytes forwarded and fingerprinted stay as sent). One that cannot be decoded is refused
    rather than passed through: its key may name an intent that already ran. Module-level, so
    that a body parsing process can run it (http/offload.py)."""
    try:
        decoded = decode(body, codings, limit)
    except Undecodable:
        raise BodyEncodingUnsupported(
            f"The body's Content-Encoding ({', '.join(codings)}) could not be decoded to read "
            "the route's key from it: only gzip and deflate are, up to max_request_body bytes "
            "decoded. Send it uncoded or in one of those."
        ) from None
    return source.body_key(decoded)


def refuse_hidden(request: web.Request, name: str | None) -> None:
    """`refuse_hidden_identity` for one header (None: none to check), off the default path."""
    if name is not None and name.lower() in hop_by_hop(request.headers):
        raise HeaderInvalid()


# The status lookup (SPEC §7.1): what became of a key, answered by the proxy from the store.
#
# Never forwarded and never a claim: a client that lost its answer can ask without any risk of an
# execution. Scoped by owner as a replay is, and an unknown key and another owner's key get the
# same `404`, so nobody learns which keys others use.


def status_document(job: Job) -> dict[str, object]:
    """The job's state, how many attempts it had and, once completed, the stored status."""
    document: dict[str, object] = {
        "key": job.key,
        "job": job.id,
        "state": str(job.state),
        "attempts": job.attempt_count,
    }
    if job.state is JobState.COMPLETED and job.response is not None:
        document["status"] = job.response.status
    return document


@dataclass(frozen=True, slots=True)
class Identify:
    """A governed request's owner, bounded body and intent, before any storage call (SPEC
    §2.1, §4-§6), with the process's settings, owner policy and body parsers (http/offload.py),
    given when built."""

    settings: Settings
    owner: OwnerPolicy
    offload: Offload

    async def body(self, request: web.Request, *, in_memory: bool = False) -> RequestBody:
        """The whole body, bounded (SPEC §9); `in_memory` keeps it out of the spool file, for the
        routes that read it before the claim (a JSON Pointer key, a webhook's signature)."""
        settings = self.settings
        limit = settings.max_request_body
        return await read_body(
            request,
            limit=limit,
            timeout=settings.server.body_read_timeout,
            spool_threshold=limit if in_memory else settings.server.spool_threshold,
        )

    async def owners(self, request: web.Request) -> tuple[str, str | None]:
        """SPEC §5: the request's owner, and in the transition to `owner.pepper` the one its
        credential had before (`derive_owners`), waiting for the identity provider's keys when its
        token names a key none of them held."""
        try:
            return derive_owners(self.owner, request.headers, request.rel_url.raw_query_string)
        except KeyNotLoaded as missing:
            return await self.owners_after_refresh(request, missing)

    async def owners_after_refresh(
        self, request: web.Request, missing: KeyNotLoaded
    ) -> tuple[str, str | None]:
        """SPEC §5: a token with a kid none of the identity provider's keys held has: wait (at most
        owner.jwt.idp.timeout) for them to be fetched again, then verify once more. The key still
        missing then is `401 owner-missing`; no key set fetched is `503 identity-unavailable`."""
        await missing.wait()
        try:
            return derive_owners(self.owner, request.headers, request.rel_url.raw_query_string)
        except KeyNotLoaded as again:
            raise OwnerMissing(UNVERIFIED) from again

    def intent(self, request: web.Request, owner: str, key: str, body: RequestBody) -> Intent:
        """SPEC §6: the fingerprint over the request as it arrived, whatever the key's source; on
        the loop, for a body that is not `heavy` (see `intent_off_loop`)."""
        url, headers = request.rel_url, request.headers
        # `_head`, in place: every governed request. Every field of Content-Encoding, in order
        # (RFC 9110 §5.3: a list may be split over several).
        content_encoding = ",".join(headers.getall(hdrs.CONTENT_ENCODING, ()))
        head = (
            request.method,
            url.raw_path,
            url.raw_query_string,
            headers.get(hdrs.CONTENT_TYPE),
            content_encoding,
            self.sent_headers(headers) if self.settings.fingerprint_headers else None,
        )
        memory, earlier = body.memory, None
        if memory is None:  # hashed as it arrived; too large to canonicalise (connection.py)
            form = body.form_sha256
            if form is None:
                digest, earlier = fingerprints_of_digest(head, body.raw_sha256)
            else:  # a body its client may encode anew, hashed as the fingerprint takes it
                digest, earlier = fingerprints_of_digest(head, form, body.form_media_type)
        elif head[5] is None:  # no `fingerprint_headers`: every governed request but those
            digest = fingerprint(head, memory, self.settings.fingerprint_exclude)
        else:
            digest, earlier = fingerprints(head, memory, self.settings.fingerprint_exclude)
        return Intent(owner, key, digest, head[0], head[1], earlier)

    async def intent_off_loop(
        self, request: web.Request, owner: str, key: str, body: RequestBody
    ) -> Intent:
        """`intent`, with a `heavy` body canonicalised off the event loop (http/offload.py)."""
        memory = body.memory
        if memory is None or not heavy(memory):
            return self.intent(request, owner, key, body)
        sent = self.sent_headers(request.headers) if self.settings.fingerprint_headers else None
        head = _head(request, sent)
        exclude = self.settings.fingerprint_exclude
        digest, earlier = await self.offload(memory, fingerprints, head, memory, exclude)
        return Intent(owner, key, digest, head[0], head[1], earlier)

    async def sourced(
        self, request: web.Request, route: Route, source: KeySource
    ) -> tuple[Intent | None, RequestBody | None, OwnerTransition | None]:
        """The intent, the body (None: not read) and the owner transition (SPEC §5, as
        `keyed`'s); the intent is None when the source gives no key and the route
        passes such requests through (`require_key`, SPEC §4.1)."""
        if route.webhook is not None:  # its owner is the sender's name, never peppered
            intent, body = await self._delivery(request, route, source, route.webhook)
            return intent, body, None
        if source.needs_body:
            owners: tuple[str, str | None] | OwnerUnstable
            try:
                owners = await self.owners(request)  # SPEC §5, as for key_header
            except OwnerUnstable as unstable:  # refused only if the body turns out to have a key
                owners = unstable
            body = await self.body(request, in_memory=True)
            key = await self._key(route, source, request, body.memory or b"")
            if key is None:
                return None, body, None
            if isinstance(owners, OwnerUnstable):
                raise owners
            owner, legacy = owners
        else:
            # SPEC §4, §9: without its key header the request is not governed and passes through
            # with its body unread (and not bounded), as on a route keyed by `key_header`.
            key = await self._key(route, source, request, b"")
            if key is None:
                return None, None, None
            refuse_hidden(request, source.header)
            owner, legacy = await self.owners(request)
            body = await self.body(request)
        # SPEC §5: the owner header named in `Connection` is refused whatever gives the key.
        refuse_hidden(request, self.owner.header)
        transition = None if legacy is None else OwnerTransition(owner, legacy)
        return await self.intent_off_loop(request, owner, key, body), body, transition

    async def _delivery(
        self,
        request: web.Request,
        route: Route,
        source: KeySource,
        webhook: WebhookVerifier,
    ) -> tuple[Intent | None, RequestBody]:
        """SPEC §4.2: nothing is claimed, stored or forwarded for a delivery that is not signed.
        The owner is the sender, so the owner header is no part of the delivery's identity."""
        body = await self.body(request, in_memory=True)
        memory = body.held()
        await off_loop(memory, webhook.verify, request.headers, memory)
        key = await self._key(route, source, request, memory)
        if key is None:
            return None, body
        refuse_hidden(request, source.header)
        return await self.intent_off_loop(request, webhook.owner, key, body), body

    async def _key(
        self, route: Route, source: KeySource, request: web.Request, body: bytes
    ) -> str | None:
        """SPEC §4.1: a source that is absent or not a valid key is `require_key`'s to decide. A
        large body is parsed off the event loop (http/offload.py)."""
        try:
            if source.needs_body:
                codings = coding_names(request.headers.getall("Content-Encoding", ()))
                if codings:
                    limit = self.settings.max_request_body
                    key = await self.offload.coded(coded_body_key, source, body, codings, limit)
                else:
                    key = await self.offload(body, source.body_key, body)
            else:
                key = source.key(request.headers, body)
        except KeyInvalid as invalid:
            if route.require_key or isinstance(invalid, KeyAmbiguous):
                raise
            return None
        if key is None and route.require_key:
            raise KeyMissing()
        return key

    def sent_headers(self, headers: CIMultiDictProxy[str]) -> str | None:
        """The fingerprint's field of `fingerprint_headers` (SPEC §6). One of them listed in
        `Connection` would be hashed and then stripped before the backend sees it (RFC 9110
        §7.6.1): refused, as the owner's and the key's header are (`refuse_hidden_identity`)."""
        fingerprinted = self.settings.fingerprint_headers
        if hdrs.CONNECTION in headers and not hop_by_hop(headers).isdisjoint(fingerprinted):
            raise HeaderInvalid()
        return headers_field(fingerprinted, headers)

    def refuse_hidden_identity(self, request: web.Request, key_header: str) -> None:
        """RFC 9110 §7.6.1 lets a client list any header in `Connection` to have it stripped. The
        job is scoped by the owner header and keyed by the key header before that stripping, so a
        client listing them would make the backend see another identity than the job's (with a
        gateway-set `header:X-User`, the trusted header would vanish): refuse it."""
        headers = request.headers
        # `hop_by_hop`'s common case, no `Connection` header, in place: every governed request.
        named = HOP_BY_HOP_HEADERS if hdrs.CONNECTION not in headers else hop_by_hop(headers)
        identity = {key_header.lower()}
        if self.owner.header is not None:
            identity.add(self.owner.header.lower())
        if named & identity:
            raise HeaderInvalid()

    async def keyed(
        self, request: web.Request, key: str
    ) -> tuple[Intent, RequestBody, OwnerTransition | None]:
        """SPEC §2.1: key, owner, bounded body and fingerprint, all before any storage call; and,
        in the transition to `owner.pepper`, the owner the credential had before it (SPEC §5)."""
        try:
            owner, legacy = derive_owners(
                self.owner, request.headers, request.rel_url.raw_query_string
            )
        except KeyNotLoaded as missing:
            owner, legacy = await self.owners_after_refresh(request, missing)
        # read_body itself, not `body`: one coroutine less on every governed request.
        body = await read_body(
            request,
            limit=self.settings.max_request_body,
            timeout=self.settings.server.body_read_timeout,
            spool_threshold=self.settings.server.spool_threshold,
        )
        transition = None if legacy is None else OwnerTransition(owner, legacy)
        # Its JSON is parsed on a thread when `heavy` (http/offload.py); a body of no more bytes
        # than OFF_LOOP_CONTAINERS has no more containers, nor is it long: not heavy, by one test.
        memory = body.memory
        if memory is not None and len(memory) > OFF_LOOP_CONTAINERS and heavy(memory):
            return await self.intent_off_loop(request, owner, key, body), body, transition
        return self.intent(request, owner, key, body), body, transition


class Proxy:
    """The proxy's answer to a request, with what it needs: the listener of `idemproxy serve`
    calls it directly (proxy/server/connection.py), the app's route through `handle`."""

    __slots__ = (
        "_govern",
        "_governed_methods",
        "_identify",
        "_in_flight",
        "_metrics",
        "_passthrough",
        "_routes",
        "_settings",
        "_status_header",
        "_store",
        "_tracing",
    )

    def __init__(self, ctx: ProxyContext, govern: Governor) -> None:
        """The collaborators of one process, taken from its context once."""
        self._settings = ctx.settings
        self._routes = ctx.routes
        self._governed_methods = ctx.governed_methods
        self._metrics = ctx.metrics
        self._tracing = ctx.tracing
        self._store = ctx.store  # the status lookup's reads (SPEC §7.1)
        self._status_header = ctx.status_header
        self._in_flight = ctx.in_flight  # a drain waits for these (proxy/drain.py)
        self._identify = Identify(ctx.settings, ctx.owner, ctx.offload)
        self._govern = govern
        self._passthrough = PassThrough(ctx.settings, ctx.upstream, ctx.metrics, ctx.tracing)

    async def answer(self, request: web.Request) -> web.StreamResponse:
        settings = self._settings
        # One request per task at a time (keep-alive requests follow each other): its ids hold
        # for its whole life, the attempt tasks it starts included, and are gone before the
        # next.
        correlated = None
        if header := settings.request_id_header:
            correlated = CURRENT.set(correlation_of(header, request.headers.getall(header, [])))
        try:
            trace = Trace(request=request)
            in_flight = self._in_flight
            in_flight.now += 1
            try:
                routing = self._route(request, trace)
                if self._tracing is not None:
                    routing = self._tracing.serve(request, trace, routing)
                response = await routing
            finally:
                in_flight.now -= 1
            # `only_response`'s test in place on the listener (one call less per request):
            # its writer started no response, or this one. aiohttp's own servers (tests, the
            # demo) ask `only_response`.
            writer = request.writer
            alone = False
            if type(writer) is HeadWriter:
                started = writer.started_headers
                alone = started is None or started is response.headers
            if not alone:
                response = only_response(self._metrics, request, response)
            trace.by_proxy = ERROR_HEADER in response.headers
            # Counted and logged once the answer is written: the log line costs the event
            # loop about 20 µs (a tenth of a replay's latency) that the client need not wait
            # for. The callback runs in a copy of this context: the line keeps the request's
            # id and span.
            asyncio.get_running_loop().call_soon(
                record,
                self._metrics,
                trace,
                response.status,
                settings.log_requests,
                settings.access_log,
                settings.log_query,
            )
        finally:
            if correlated is not None:
                CURRENT.reset(correlated)
        return response

    async def expect_continue(self, request: web.Request) -> web.StreamResponse | None:
        """RFC 9110 §10.1.1: refuse an over-size governed body before inviting it (SPEC §9:
        413); otherwise answer as aiohttp's default handler does."""
        if request.version != HttpVersion11:
            return None
        if request.headers.get("Expect", "").lower() != "100-continue":
            return self._refused_before_body(request, ExpectationFailed())
        # `OPTIONS *` is never governed (`_route`).
        governed = request.method in self._governed_methods and not asks_the_server(
            request.method, request.raw_path
        )
        declared = request.content_length
        if (
            governed
            and declared is not None
            and declared > self._settings.max_request_body
            and self._reads_bounded(request)
        ):
            return self._refused_before_body(request, BodyTooLarge())
        if governed:
            refused = self._refused_by_head(request)
            if refused is not None:
                return self._refused_before_body(request, refused)
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the interim response is not part of the body's size
        return None

    def _refused_before_body(self, request: web.Request, error: ProblemError) -> web.StreamResponse:
        """A refusal of `expect_continue` (417, 413), which runs before `answer`: with the
        request's id, as every problem of the proxy carries it (SPEC §8), and the connection
        closed after it."""
        settings = self._settings
        correlated = None
        if header := settings.request_id_header:
            correlated = CURRENT.set(correlation_of(header, request.headers.getall(header, [])))
        try:
            refused = problem_response(
                error, profile=settings.profile, types=settings.problem_types
            )
            # Counted and logged as any refusal `answer` makes (SPEC §13): a 413 decided from
            # the head is the same refusal as one decided from the body.
            trace = Trace(request=request, by_proxy=True)
            with contextlib.suppress(ProblemError):
                trace.route = self._routes.resolve(request.path, request.host, request.rel_url)
            trace.problem(error)
            record(
                self._metrics,
                trace,
                refused.status,
                log_requests=settings.log_requests,
                access_log=settings.access_log,
                log_query=settings.log_query,
            )
        finally:
            if correlated is not None:
                CURRENT.reset(correlated)
        # RFC 9110 §10.1.1: the body was never invited, and the client may send it or its next
        # request: either would be read as the other. Say that the connection ends here.
        refused.force_close()
        return refused

    async def _answer_status(
        self, request: web.Request, route: Route, trace: Trace
    ) -> web.StreamResponse:
        trace.outcome = RequestOutcome.STATUS_LOOKUP
        header = self._status_header or ""
        key = parse_key(request.headers.getall(header, []))
        if key is None:  # the header is there (the handler saw it), so this is never reached
            raise KeyNotFound()
        if route.key_source is not None:
            key = route.key_source.prefixed(key)
        if route.webhook is not None:
            # SPEC §4.2: a webhook route's jobs belong to its sender, whom no lookup can prove
            # to be; operators see them with `idemproxy jobs list --owner webhook:<sender>`.
            raise KeyNotFound()
        # SPEC §5, §7.1: the owner header named in `Connection` is refused as on a governed request.
        refuse_hidden(request, self._identify.owner.header)
        owner, legacy = await self._identify.owners(request)
        trace.owner = owner
        job = await self._store.get(owner, key)
        if job is None and legacy is not None:  # SPEC §5: a job from before `owner.pepper`
            job = await self._store.get(legacy, key)
        # SPEC §3.1: only completed and released jobs expire; an unknown or in-flight one past its
        # ttl is still there, and "not found" (new-key-safe) would invite a second execution.
        if job is None or (job.expired and job.state in EXPIRABLE):
            raise KeyNotFound()
        trace.job_id = job.id
        return web.Response(
            body=json.dumps(status_document(job)).encode(),
            content_type="application/json",
            headers={"Cache-Control": "no-store"},
        )

    def _refused_by_head(self, request: web.Request) -> ProblemError | None:
        """What `_route` refuses a governed request for from its head alone on a route whose key is
        a header (its key, its owner: SPEC §4, §5, §8), found before its body is invited (RFC 9110
        §10.1.1): a client is not made to upload what is refused anyway. None when its head holds
        nothing `_route` refuses it for first, or something else first (the host, the transfer
        coding, the path: `_route` answers those as it always does)."""
        headers = request.headers
        if (
            host_problem(headers.get(hdrs.HOST), request.raw_path) is not None
            or hdrs.TRANSFER_ENCODING in headers
            or not request.raw_path.isascii()
        ):
            return None
        try:
            route = self._routes.resolve(request.path, request.host, request.rel_url)
            if route is None or route.key_source is not None:
                return None
            key_header = self._settings.key_header
            if parse_key(headers.getall(key_header, [])) is None:
                return KeyMissing() if route.require_key else None
            self._identify.refuse_hidden_identity(request, key_header)
            derive_owners(self._identify.owner, headers, request.rel_url.raw_query_string)
        except KeyNotLoaded:  # the token may be good: its key is fetched once the body came
            return None
        except ProblemError as error:
            return None if isinstance(error, PathInvalid) else error
        return None

    def _reads_bounded(self, request: web.Request) -> bool:
        """Whether `_route` would read this governed request's body up to `max_request_body`: with
        a key on a default route; always on a webhook or body-keyed route (the body is read before
        anything is known, SPEC §4.1, §4.2); with its key header on a header-keyed route."""
        try:
            route = self._routes.resolve(request.path, request.host, request.rel_url)
        except PathInvalid:  # `_route` answers 400; refused at once as before it knew the route
            route = None
        if route is None or route.key_source is None:
            return self._settings.key_header in request.headers
        source = route.key_source
        if route.webhook is not None or source.header is None:
            return True
        return source.header in request.headers

    async def _route(self, request: web.Request, trace: Trace) -> web.StreamResponse:
        try:
            host, target = request.headers.get(hdrs.HOST), request.raw_path
            # `host_problem`'s common case in place: an origin-form target and a Host whose
            # verdict `valid_host` keeps (a C-level cache hit, no call into http/headers.py).
            if (
                not (target.startswith("/") and valid_host(host))
                and (host_refused := host_problem(host, target)) is not None
            ):
                return self._refuse_host(trace, host_refused)
            if hdrs.TRANSFER_ENCODING in request.headers and transfer_codings(request.headers) != [
                "chunked"
            ]:
                return self._refuse_transfer_coding(trace)
            route = self._routes.resolve(request.path, request.host, request.rel_url)
            if route is None:
                raise NoRoute()
            trace.route = route
            if request.method not in self._governed_methods or (
                request.raw_path[0] != "/" and asks_the_server(request.method, request.raw_path)
            ):
                # `OPTIONS *` (RFC 9112 §3.2.4) names no resource, and so no intent to keep.
                if self._status_header is not None and _asks_status(self._status_header, request):
                    return await self._answer_status(request, route, trace)  # SPEC §7.1
                return await self._passthrough.forward(
                    request, route, trace=trace
                )  # SPEC §4: keys ignored
            if not request.raw_path.isascii() and not _utf8(request.raw_path):
                # Bytes that are no UTF-8 (the Python parser lets them through as surrogates; the C
                # parser refuses them): no store can keep the job's path, and the claim failed as
                # `503 store-unavailable`, blaming a healthy store.
                raise PathInvalid("The request target is not valid UTF-8.")
            if route.key_source is not None:  # SPEC §4.1, §4.2: off the default path
                return await self._govern_sourced(request, route, trace)
            key = parse_key(request.headers.getall(self._settings.key_header, []))
            if key is None:
                if route.require_key:
                    raise KeyMissing()
                return await self._passthrough.forward(request, route, trace=trace)
            self._identify.refuse_hidden_identity(request, self._settings.key_header)
            intent, body, transition = await self._identify.keyed(request, key)
            trace.owner = intent.owner
            # Positional: a dataclass's keyword call costs twice as much, on every governed request.
            response = await self._govern(
                GovernedRequest(request, route, intent, body, trace, transition)
            )
            if response is None:
                # The store could not take the claim and `on_store_error: passthrough` forwards the
                # request ungoverned (SPEC §11). A response is a mapping: never test it for truth.
                return await self._passthrough.forward(request, route, body, trace=trace)
            return response
        except ProblemError as error:
            return self._refused(request, trace, error)

    def _refused(
        self, request: web.Request, trace: Trace, error: ProblemError
    ) -> web.StreamResponse:
        if isinstance(error, ClientDisconnected):
            client_gone(self._metrics, request, DisconnectStage.REQUEST_BODY)
        trace.problem(error)
        refused = problem_response(
            error, profile=self._settings.profile, types=self._settings.problem_types
        )
        if isinstance(error, BodyInvalid):  # where the next request would begin is unknown
            refused.force_close()
        return refused

    async def _govern_sourced(
        self, request: web.Request, route: Route, trace: Trace
    ) -> web.StreamResponse:
        """A governed request on a route with a key source or a webhook."""
        assert route.key_source is not None  # the caller's test, for mypy
        intent, body, transition = await self._identify.sourced(request, route, route.key_source)
        if intent is None or body is None:
            return await self._passthrough.forward(request, route, body, trace=trace)
        trace.owner = intent.owner
        response = await self._govern(
            GovernedRequest(request, route, intent, body, trace, transition)
        )
        if response is None:  # SPEC §11, as in `_route`
            return await self._passthrough.forward(request, route, body, trace=trace)
        return response

    def _refuse_transfer_coding(self, trace: Trace) -> web.StreamResponse:
        """RFC 9112 §6.1: aiohttp removes the final `chunked` of `gzip, chunked` and hands on the
        still-coded bytes as the body; forwarded (and fingerprinted) as the identity body, they
        would mean something else to the upstream. The proxy decodes no other transfer coding, so
        the request is refused, and the connection closed, as for the framings aiohttp refuses."""
        error = HeaderInvalid(
            "The proxy decodes no transfer coding but a single chunked (RFC 9112 §6.1)."
        )
        trace.problem(error)
        response = problem_response(
            error, profile=self._settings.profile, types=self._settings.problem_types
        )
        response.force_close()
        return response

    def _refuse_host(self, trace: Trace, detail: str) -> web.StreamResponse:
        """RFC 9112 §3.2: 400 for an invalid Host value, or one the target's authority contradicts,
        and the connection closed, as for the framing errors aiohttp's parser refuses
        (docs/reliability.md, Hostile HTTP): the backend would see one name, the routing another."""
        error = HeaderInvalid(detail)
        trace.problem(error)
        response = problem_response(
            error, profile=self._settings.profile, types=self._settings.problem_types
        )
        response.force_close()
        return response


async def handle(request: web.Request) -> web.StreamResponse:
    """The app's one route (proxy/server/any_path.py) on aiohttp's own servers (tests, the
    demo): `Proxy.answer`."""
    return await request.app[PROXY_ROUTE].handler(request)


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """The route's handler of `Expect`: `Proxy.expect_continue`."""
    return await request.app[PROXY_ROUTE].expect_handler(request)


def _asks_status(header: str, request: web.Request) -> bool:
    return request.method == hdrs.METH_GET and header in request.headers


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
