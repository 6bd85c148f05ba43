"""Contract-gated fallbacks (SPEC §3.4).

A group may declare a response contract (a JSON Schema for its 2xx bodies) and sample requests.
A fallback is eligible only after its answers to the samples validated; at run time, a 2xx
from any upstream of the group that violates the contract is never stored, replayed or passed
on, and makes the job unknown (core/machine.py, classify_breach): the upstream acted.

A coded answer (`Content-Encoding: gzip`, which most HTTP clients ask for) is checked decoded;
the bytes stored and sent stay as the upstream sent them. So that an upstream preferring `br`
does not make every answer uncheckable, a contract route asks its upstreams only for codings the
proxy can undo (`ask_checkable`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from aiohttp import hdrs
from jsonschema import validators
from jsonschema.exceptions import SchemaError
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from idemproxy.config.settings import ContractSettings
from idemproxy.errors import ConfigError
from idemproxy.http.codings import DECODABLE, Undecodable, coding_names, decode
from idemproxy.http.headers import Edits
from idemproxy.http.offload import in_thread, off_loop
from idemproxy.proxy.upstream.client import UpstreamClient, UpstreamFailure
from idemproxy.redact import escaped, redact_url

log = logging.getLogger(__name__)
_MAX_REPORTED = 5
# What a sample's answer is read up to, decoded or not.
_SAMPLE_LIMIT = 1024 * 1024
# The `Accept-Encoding` elements a contract route passes upstream: codings the proxy can undo
# (http/codings.py; `x-gzip` is `gzip`, RFC 9110 §8.4.1.3) and `identity`.
_CHECKABLE = DECODABLE | {"x-gzip", "identity"}


@dataclass(frozen=True, slots=True)
class Sample:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class Contract:
    def __init__(self, settings: ContractSettings) -> None:
        self.settings = settings
        # SPEC §12: invalid configuration fails at start-up with a message naming the field, so a
        # schema file that is not JSON, or not a valid JSON Schema, is a ConfigError.
        try:
            schema = json.loads(settings.schema_file.read_text())
            validator_class = validators.validator_for(schema)
            validator_class.check_schema(schema)
        except (ValueError, TypeError, SchemaError) as exc:
            reason = exc.message if isinstance(exc, SchemaError) else str(exc)
            raise ConfigError(f"contract.schema_file {settings.schema_file}: {reason}") from exc
        self._validator = validator_class(schema)
        self.samples = load_samples(settings.samples_file)

    async def check(
        self, status: int, headers: CIMultiDictProxy[str], body: bytes | None, limit: int
    ) -> list[str]:
        """`coded_violations` of a captured response, off the event loop when it is long work
        (http/offload.py). A coded body always is: a decode's work follows what it decodes to,
        not its coded size (SPEC §7)."""
        codings = coding_names(headers.getall(hdrs.CONTENT_ENCODING, ()))
        if codings and body and _checked(status):
            return await in_thread(self.coded_violations, status, body, codings, limit)
        return await off_loop(body or b"", self.violations, status, body)

    def coded_violations(
        self, status: int, body: bytes | None, codings: Sequence[str], limit: int
    ) -> list[str]:
        """`violations` of the body with its content `codings` undone, to at most `limit` bytes.
        A body the proxy cannot decode (a coding other than gzip and deflate, bytes that are
        not what the coding says, more than `limit` decoded) cannot be checked: a breach that
        names the coding (SPEC §3.4)."""
        if not codings or not body or not _checked(status):
            return self.violations(status, body)
        try:
            decoded = decode(body, list(codings), limit)
        except Undecodable:
            # The names are the upstream's: escaped for the attempt's `error` column.
            named = escaped(", ".join(codings))
            return [
                f"body coded with {named} cannot be checked against the contract: only gzip and"
                " deflate are decoded, up to max_stored_body bytes"
            ]
        return self.violations(status, decoded)

    def violations(self, status: int, body: bytes | None) -> list[str]:
        """Why a response breaks the contract; empty when it honours it (or is not a 2xx)."""
        if not _checked(status):
            return []
        if body is None:
            return ["body too large to check against the contract"]
        try:
            document = json.loads(body)
        except ValueError:
            return ["body is not JSON"]
        except RecursionError:  # jsonschema validates recursively: no deep_json fallback helps
            return ["body is nested too deeply to check against the contract"]
        try:
            errors = self._validator.iter_errors(document)
            return [_describe(e) for _, e in zip(range(_MAX_REPORTED), errors, strict=False)]
        except RecursionError:
            return ["body is nested too deeply to check against the contract"]


@dataclass(slots=True)
class ContractGate:
    """Which fallbacks of one group have passed their contract check."""

    contract: Contract
    fallbacks: tuple[str, ...]
    eligible: tuple[str, ...] = ()
    reports: dict[str, list[str]] = field(default_factory=dict)
    # The headers the route sets upstream (its API key): samples are sent as requests are.
    edits: Mapping[str, Edits] = field(default_factory=lambda: MappingProxyType({}), repr=False)
    # The route's `upstream_timeout` (None: the global one): a sample waits as requests do.
    upstream_timeout: float | None = None

    async def check(self, client: UpstreamClient) -> None:
        results = await asyncio.gather(
            *(
                check_upstream(
                    client, url, self.contract, self.edits.get(url, ()), self.upstream_timeout
                )
                for url in self.fallbacks
            )
        )
        self.reports = dict(zip(self.fallbacks, results, strict=True))
        self.eligible = tuple(url for url in self.fallbacks if not self.reports[url])
        for url, problems in self.reports.items():
            if problems:
                log.warning("fallback %s is not eligible: %s", redact_url(url), "; ".join(problems))


async def check_upstream(
    client: UpstreamClient,
    base: str,
    contract: Contract,
    edits: Edits = (),
    upstream_timeout: float | None = None,
) -> list[str]:
    """Send every sample to `base`, with the route's header edits and upstream timeout; the
    violations found, each prefixed with its sample."""
    problems: list[str] = []
    for number, sample in enumerate(contract.samples, start=1):
        try:
            async with asyncio.timeout(contract.settings.timeout):
                status, body, codings = await _send(client, base, sample, edits, upstream_timeout)
        except (UpstreamFailure, TimeoutError) as exc:
            problems.append(f"sample {number}: no answer ({exc})")
            continue
        if not 200 <= status < 300:
            # An error answer proves nothing about the contract: the upstream must show it.
            problems.append(f"sample {number}: answered {status}, not a 2xx response")
            continue
        broken = contract.coded_violations(status, body, codings, _SAMPLE_LIMIT)
        problems += [f"sample {number}: {v}" for v in broken]
    return problems


def ask_checkable(headers: CIMultiDict[str]) -> None:
    """SPEC §3.4: the request's `Accept-Encoding` with only the codings the proxy can undo to
    check an answer (gzip, deflate, identity); `identity` when it named none of them. A
    request without the field goes without it."""
    fields = headers.getall(hdrs.ACCEPT_ENCODING, None)
    if fields is None:
        return
    elements = (element.strip() for field in fields for element in field.split(","))
    kept = [e for e in elements if e.partition(";")[0].strip().lower() in _CHECKABLE]
    headers[hdrs.ACCEPT_ENCODING] = ", ".join(kept) if kept else "identity"


def _checked(status: int) -> bool:
    """Only a 2xx is held to the contract: an error answer has a shape of its own."""
    return 200 <= status < 300


async def _send(
    client: UpstreamClient, base: str, sample: Sample, edits: Edits, timeout: float | None
) -> tuple[int, bytes | None, list[str]]:
    url = URL(base + sample.path, encoded=True)
    headers = CIMultiDict(sample.headers)
    # The client sends the Host among the headers in the URL's place (SPEC §10): a sample's
    # own stays ignored, as it was, and a sample goes to the upstream by its own name.
    headers.popall("Host", None)
    for edit in edits:
        edit.apply(headers)
    ask_checkable(headers)  # as requests of the route are sent
    request = client.request(sample.method, url, headers, sample.body, timeout=timeout)
    async with request as response:
        body, whole = await UpstreamClient.read_body(response, _SAMPLE_LIMIT)
        codings = coding_names(response.headers.getall(hdrs.CONTENT_ENCODING, ()))
        return response.status, body if whole else None, codings


def load_samples(path: Any) -> list[Sample]:
    samples: list[Sample] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            body = item.get("body")
            encoded = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            samples.append(
                Sample(
                    method=str(item.get("method", "POST")).upper(),
                    path=str(item["path"]),
                    headers={str(k): str(v) for k, v in item.get("headers", {}).items()},
                    body=b"" if body is None else encoded,
                )
            )
        except (ValueError, KeyError, AttributeError) as exc:
            raise ConfigError(f"contract.samples_file line {number}: {exc}") from exc
    if not samples:
        raise ConfigError(f"contract.samples_file {path} holds no samples")
    return samples


def _describe(error: Any) -> str:
    # The path holds the upstream's own member names, and the text goes into the attempt's
    # `error` column: a NUL (PostgreSQL text refuses it) or a lone surrogate (`"\udce9"` in the
    # JSON; no UTF-8 holds it) is written escaped, as jsonschema's message writes values (repr).
    where = "/" + "/".join(str(part) for part in error.absolute_path)
    return f"{escaped(where)}: {error.message}"


async def keep_checking(gates: list[ContractGate], client: UpstreamClient) -> None:
    """Re-check each gate's fallbacks on its own interval (0: checked at start-up only)."""
    await asyncio.gather(
        *(_recheck(gate, client) for gate in gates if gate.contract.settings.interval > 0)
    )


async def _recheck(gate: ContractGate, client: UpstreamClient) -> None:
    while True:
        await asyncio.sleep(gate.contract.settings.interval)
        await gate.check(client)
