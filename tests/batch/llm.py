"""A fake paid LLM API (named as such): chat completions in OpenAI's shape, messages in
Anthropic's, a bill per Idempotency-Key, and request and token limits that answer real 429s.

    POST /v1/chat/completions   usage.prompt_tokens / completion_tokens / total_tokens
    POST /v1/messages           usage.input_tokens / output_tokens

`"stream": true` answers server-sent events as each API streams: OpenAI's chunks, with a last
chunk carrying the usage only if `"stream_options": {"include_usage": true}`, and Anthropic's
`message_start` (the input) … `message_delta` (the output). With `plain_text` every answer is a
`text/plain` body that says nothing of its usage — billed all the same.

The usage it reports is a function of the request alone (the prompt at a token per 4 bytes, or
by the `tokenizer` a test gives — per character, per byte — plus `per_message` tokens a message,
as a chat template adds; and up to `max_tokens` of answer), so a test knows what every item
costs. Limits work as
providers' do, scaled down: a bucket of `requests` and one of `tokens` per `window` seconds
(the test's "minute"), refilled continuously; a request takes one request and its prompt plus
its `max_tokens` at arrival, corrected to what it used once answered. Over a limit it answers
`429` with `Retry-After` (whole seconds, until the request would fit) or, with `reset_headers`,
OpenAI's `x-ratelimit-remaining-*` and `x-ratelimit-reset-*` (`250ms`, until the limit is full
again), and bills nothing.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Bucket:
    capacity: float
    window: float
    level: float = field(init=False)
    at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.level = self.capacity

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.capacity / self.window)
        self.at = now

    def wait(self, amount: float) -> float:
        return max(0.0, (amount - self.level) * self.window / self.capacity)


def quarter_bytes(text: str) -> int:
    return math.ceil(len(text.encode()) / 4)


def per_character(text: str) -> int:
    return len(text)


def per_byte(text: str) -> int:
    return len(text.encode())


@dataclass
class LlmApi:
    requests: float | None = None  # per window
    tokens: float | None = None  # per window
    window: float = 1.0
    reset_headers: bool = False
    delay: float = 0.0
    tokenizer: Callable[[str], int] = quarter_bytes
    per_message: int = 0  # tokens a chat template adds to each message (and to start the reply)
    plain_text: bool = False
    executions: Counter[str] = field(default_factory=Counter)  # billed calls per key
    billed: Counter[str] = field(default_factory=Counter)  # tokens billed per key
    arrivals: list[float] = field(default_factory=list)  # every request, refused ones too
    refusals: list[tuple[float, float]] = field(default_factory=list)  # (when, seconds asked)
    in_flight: int = 0
    most_in_flight: int = 0
    _buckets: dict[str, Bucket] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("requests", "tokens"):
            limit = getattr(self, name)
            if limit is not None:
                self._buckets[name] = Bucket(limit, self.window)

    @property
    def billed_tokens(self) -> int:
        return sum(self.billed.values())

    def admit(self, reserved: int) -> tuple[float, dict[str, str]] | None:
        """None: taken from the buckets; else the wait and the headers of a 429."""
        now = time.monotonic()
        wanted = {"requests": 1.0, "tokens": float(reserved)}
        waits = {}
        for name, bucket in self._buckets.items():
            bucket.refill(now)
            waits[name] = bucket.wait(wanted[name])
        if all(wait == 0 for wait in waits.values()):
            for name, bucket in self._buckets.items():
                bucket.level -= wanted[name]
            return None
        asked, headers = self._refusal(max(waits.values()))
        self.refusals.append((now, asked))
        return asked, headers

    def _refusal(self, wait: float) -> tuple[float, dict[str, str]]:
        """How long a 429 asks the client to wait, and the headers that say so."""
        if not self.reset_headers:
            seconds = max(1, math.ceil(wait))
            return float(seconds), {"Retry-After": str(seconds)}
        headers, fulls, exhausted = {}, [], []
        for name, bucket in self._buckets.items():
            # As OpenAI's: the time until the limit is back to its full state.
            millis = max(
                1,
                math.ceil(
                    (bucket.capacity - bucket.level) * bucket.window / bucket.capacity * 1000
                ),
            )
            remaining = max(0, int(bucket.level))
            headers[f"x-ratelimit-remaining-{name}"] = str(remaining)
            headers[f"x-ratelimit-reset-{name}"] = f"{millis}ms"
            fulls.append(millis / 1000)
            if remaining == 0:
                exhausted.append(millis / 1000)
        return (max(exhausted) if exhausted else min(fulls)), headers

    def correct(self, reserved: int, used: int) -> None:
        bucket = self._buckets.get("tokens")
        if bucket is not None:
            bucket.refill(time.monotonic())
            bucket.level = min(bucket.capacity, bucket.level + reserved - used)


def prompt_text(body: dict[str, Any]) -> str:
    parts = [str(message.get("content", "")) for message in body.get("messages", [])]
    return str(body.get("system", "")) + "".join(parts)


def usage_of(
    body: dict[str, Any], tokenizer: Callable[[str], int] = quarter_bytes, per_message: int = 0
) -> tuple[int, int]:
    """(input, output) tokens a request uses: known to the tests before they send it."""
    text = prompt_text(body)
    messages = len(body.get("messages", []))
    prompt = tokenizer(text) + per_message * (messages + 1 if messages else 0)
    return prompt, min(int(body.get("max_tokens", 16)), 3 + len(text) % 13)


API = web.AppKey("api", LlmApi)


async def _complete(request: web.Request) -> web.StreamResponse:
    api = request.app[API]
    api.arrivals.append(time.monotonic())
    body = await request.json()
    prompt, output = usage_of(body, api.tokenizer, api.per_message)
    reserved = prompt + int(body.get("max_tokens", 16))
    refused = api.admit(reserved)
    if refused is not None:
        error = {"error": {"type": "rate_limit_exceeded", "message": "slow down"}}
        return web.json_response(error, status=429, headers=refused[1])
    api.in_flight += 1
    api.most_in_flight = max(api.most_in_flight, api.in_flight)
    try:
        await asyncio.sleep(api.delay)
    finally:
        api.in_flight -= 1
    api.correct(reserved, prompt + output)
    key = request.headers.get("Idempotency-Key", "")
    api.executions[key] += 1
    api.billed[key] += prompt + output
    model = str(body.get("model", "unnamed"))
    if api.plain_text:
        return web.Response(text="A question.", content_type="text/plain")
    if body.get("stream"):
        return await _stream(request, _events(request.path, body, prompt, output))
    if request.path == "/v1/messages":
        answer: dict[str, Any] = {
            "id": f"msg_{api.executions.total()}",
            "type": "message",
            "model": model + "-20241022",
            "content": [{"type": "text", "text": "A question."}],
            "usage": {"input_tokens": prompt, "output_tokens": output},
        }
    else:
        answer = {
            "id": f"chatcmpl-{api.executions.total()}",
            "object": "chat.completion",
            "model": model + "-2024-07-18",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "A question."}}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": output,
                      "total_tokens": prompt + output},
        }  # fmt: skip
    return web.json_response(answer)


def _events(path: str, body: dict[str, Any], prompt: int, output: int) -> list[str]:
    """The `event:`/`data:` blocks of a streamed answer, in OpenAI's or Anthropic's shape."""
    if path == "/v1/messages":
        start = {
            "type": "message_start",
            "message": {"id": "msg", "usage": {"input_tokens": prompt, "output_tokens": 1}},
        }
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": output},
        }
        text = {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "A"}}
        named = [
            ("message_start", start),
            ("content_block_delta", text),
            ("message_delta", delta),
            ("message_stop", {"type": "message_stop"}),
        ]
        return [f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in named]
    chunks: list[Any] = [
        {
            "object": "chat.completion.chunk",
            "usage": None,
            "choices": [{"index": 0, "delta": {"content": word}}],
        }
        for word in ("A ", "question.")
    ]
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append(
            {
                "object": "chat.completion.chunk",
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": output,
                    "total_tokens": prompt + output,
                },
            }
        )
    return [*(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks), "data: [DONE]\n\n"]


async def _stream(request: web.Request, events: list[str]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for event in events:
        await response.write(event.encode())
    await response.write_eof()
    return response


def llm_app(api: LlmApi) -> web.Application:
    app = web.Application()
    app[API] = api
    app.router.add_post("/v1/chat/completions", _complete)
    app.router.add_post("/v1/messages", _complete)
    return app


def llm_items(count: int, *, max_tokens: int = 40) -> list[dict[str, Any]]:
    """Questions, alternately for an OpenAI-shaped and an Anthropic-shaped endpoint."""
    items = []
    for n in range(count):
        prompt = f"Write exam question {n} about chapter {n % 7}." + " detail" * (n % 5)
        messages = [{"role": "user", "content": prompt}]
        model = "claude-3-5-haiku" if n % 2 else "gpt-4o-mini"
        path = "/v1/messages" if n % 2 else "/v1/chat/completions"
        body = {"model": model, "max_tokens": max_tokens, "messages": messages}
        items.append({"id": f"q-{n:04d}", "method": "POST", "path": path, "body": body})
    return items


PRICES_YAML = """\
currency: USD
models:
  gpt-4o-mini: {input: 0.15, output: 0.60}
  claude-3-5-haiku: {input: 0.80, output: 4.00}
"""
