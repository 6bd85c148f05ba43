"""Upstreams of a group for the fail-over, hedging and contract tests (SPEC §3.4).

Each `NamedUpstream` is a small aiohttp app with behaviour of its own, so that a primary and its
fallbacks can differ: it waits `delay` seconds, then answers `status` with a JSON body that names
it (`{"id", "upstream", "execution", "choices": [...]}`, the shape of `CHAT_SCHEMA`), or `raw`
bytes. The
behaviour is plain attributes, changeable between requests. Requests without an
`Idempotency-Key` are the contract check's samples: they get `sample_document` when one is set.

Every request is recorded twice: in `received` when it arrives, in `finished` once its answer
is about to go out, so a test can wait for a slow racer to have finished.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.support.backend import Execution

# The response contract of the chat-like group used by these tests (JSON Schema).
CHAT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["id", "choices"],
    "properties": {
        "id": {"type": "string"},
        "choices": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["text"],
                "properties": {"text": {"type": "string"}},
            },
        },
    },
}
# Valid JSON of the wrong shape: fails CHAT_SCHEMA.
WRONG_SHAPE: dict[str, Any] = {"answer": "forty-two"}


@dataclass
class NamedUpstream:
    name: str
    status: int = 200
    delay: float = 0.0
    document: dict[str, Any] | None = None  # None: the default body naming this upstream
    sample_document: dict[str, Any] | None = None  # for requests without an Idempotency-Key
    raw: bytes | None = None  # answer these bytes (text/html) instead of a JSON document
    received: list[Execution] = field(default_factory=list)
    finished: list[Execution] = field(default_factory=list)
    url: str = ""

    def count(self, key: str | None = None) -> int:
        """Requests received (with this Idempotency-Key, when given)."""
        if key is None:
            return len(self.received)
        return sum(1 for e in self.received if e.header("Idempotency-Key") == key)

    @property
    def samples(self) -> int:
        """Contract-check samples received (requests without an Idempotency-Key)."""
        return sum(1 for e in self.received if e.header("Idempotency-Key") is None)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)  # aiohttp's default: 1 MiB
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    async def _handle(self, request: web.Request) -> web.Response:
        execution = Execution(
            request.method, request.path_qs, list(request.headers.items()), await request.read()
        )
        self.received.append(execution)
        status, delay = self.status, self.delay
        if delay:
            await asyncio.sleep(delay)
        self.finished.append(execution)
        if self.raw is not None:
            return web.Response(status=status, body=self.raw, content_type="text/html")
        document = self.document
        if execution.header("Idempotency-Key") is None and self.sample_document is not None:
            document = self.sample_document
        if document is None:
            number = len(self.received)
            document = {
                "id": f"{self.name}-{number}",
                "upstream": self.name,
                "execution": number,
                "choices": [{"text": f"answered by {self.name}"}],
            }
        return web.json_response(document, status=status)


def write_contract(directory: Any, *, samples: int = 2) -> dict[str, str]:
    """CHAT_SCHEMA and `samples` sample requests in `directory`; the route's `contract` setting."""
    schema = directory / "chat.schema.json"
    schema.write_text(json.dumps(CHAT_SCHEMA))
    lines = [
        json.dumps({"method": "POST", "path": "/v1/chat", "body": {"prompt": f"sample {n}"}})
        for n in range(1, samples + 1)
    ]
    sample_file = directory / "chat.samples.jsonl"
    sample_file.write_text("\n".join(lines) + "\n")
    return {"schema_file": str(schema), "samples_file": str(sample_file)}
