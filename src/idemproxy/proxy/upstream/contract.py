"""Contract-gated fallbacks (SPEC §3.4).

A group may declare a response contract (a JSON Schema for its 2xx bodies) and sample requests.
A fallback is eligible only after its answers to the samples validated; at run time, a 2xx
from any upstream of the group that violates the contract is never stored, replayed or passed
on, and makes the job unknown (core/attempts.py, classify_breach): the upstream acted.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from jsonschema import validators
from jsonschema.exceptions import SchemaError
from multidict import CIMultiDict
from yarl import URL

from idemproxy.config.settings import ContractSettings
from idemproxy.errors import ConfigError
from idemproxy.proxy.upstream.client import UpstreamClient, UpstreamFailure
from idemproxy.proxy.upstream.target import Edits
from idemproxy.redact import escaped, redact_url

log = logging.getLogger(__name__)
_MAX_REPORTED = 5


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

    def violations(self, status: int, body: bytes | None) -> list[str]:
        """Why a response breaks the contract; empty when it honours it (or is not a 2xx)."""
        if not 200 <= status < 300:
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
                status, body = await _send(client, base, sample, edits, upstream_timeout)
        except (UpstreamFailure, TimeoutError) as exc:
            problems.append(f"sample {number}: no answer ({exc})")
            continue
        if not 200 <= status < 300:
            # An error answer proves nothing about the contract: the upstream must show it.
            problems.append(f"sample {number}: answered {status}, not a 2xx response")
            continue
        problems += [f"sample {number}: {v}" for v in contract.violations(status, body)]
    return problems


async def _send(
    client: UpstreamClient, base: str, sample: Sample, edits: Edits, timeout: float | None
) -> tuple[int, bytes | None]:
    url = URL(base + sample.path, encoded=True)
    headers = CIMultiDict(sample.headers)
    # The client sends the Host among the headers in the URL's place (SPEC §10): a sample's
    # own stays ignored, as it was, and a sample goes to the upstream by its own name.
    headers.popall("Host", None)
    for edit in edits:
        edit.apply(headers)
    request = client.request(sample.method, url, headers, sample.body, timeout=timeout)
    async with request as response:
        body, whole = await UpstreamClient.read_body(response, 1024 * 1024)
        return response.status, body if whole else None


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
