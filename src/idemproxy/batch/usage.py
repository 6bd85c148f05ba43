"""Pure: the tokens an answer says it used, and the tokens a request may use before it is sent.

Answers are read in the two shapes LLM APIs report usage in, then in any shape given as JSON
pointers (RFC 6901), from a JSON body or from the events of a streamed one (stream.py):

    OpenAI chat completions   usage.prompt_tokens, usage.completion_tokens (usage.total_tokens)
    OpenAI responses,         usage.input_tokens, usage.output_tokens; Anthropic's
    Anthropic messages        usage.cache_creation_input_tokens and cache_read_input_tokens are
                              input tokens too (billed at other rates: counted as input, which
                              over-counts cache reads rather than missing them)

Before sending, an item's tokens are estimated the way providers count a request against a
tokens-per-minute limit: the prompt at one token per 4 bytes of the request body, plus the most
the answer may hold — the body's `max_tokens`, `max_completion_tokens` or `max_output_tokens`.

A budget needs more than an estimate: its worst case (`worst_case`) must be a true upper bound,
and 4 bytes a token is not one (a CJK character is 3 bytes and often a token of its own). The
tokenizers of LLM APIs (OpenAI's, Anthropic's, Llama's) are byte-level BPE: every token of the
text stands for at least one byte, so the prompt counts at most one token per byte of the request
body. The body holds every byte of the prompt's text, and its JSON around each message (at least
`{"content":"","role":""}`, 24 bytes) more than pays for the few tokens a chat template adds per
message (OpenAI counts 3, and 3 to start the reply).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from idemproxy.batch.input import Item
from idemproxy.batch.records import Outcome, ResultRecord, encode_body
from idemproxy.batch.stream import is_event_stream, usage_documents

# The request fields that cap the answer's tokens (OpenAI chat, OpenAI responses, Anthropic).
OUTPUT_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
CHOICE_FIELDS = ("n", "best_of")
BYTES_PER_TOKEN = 4


@dataclass(frozen=True)
class Usage:
    input_tokens: int
    output_tokens: int
    model: str | None = None  # the request's `model`, else the answer's

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def to_json(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "total_tokens": self.total_tokens,
            "model": self.model,
        }

    @classmethod
    def from_json(cls, value: object) -> Usage | None:
        """A result line's `usage`; None for a line without one (or one we did not write)."""
        if not isinstance(value, Mapping):
            return None
        tokens = _count(value.get("input_tokens")), _count(value.get("output_tokens"))
        if tokens[0] is None or tokens[1] is None:
            return None
        model = value.get("model")
        return cls(tokens[0], tokens[1], model if isinstance(model, str) else None)


@dataclass(frozen=True)
class UsagePointers:
    """Where an answer keeps its input and output token counts (RFC 6901 JSON pointers)."""

    input: str
    output: str
    extra_input: tuple[str, ...] = ()  # added to the input when present


OPENAI_CHAT = UsagePointers("/usage/prompt_tokens", "/usage/completion_tokens")
INPUT_OUTPUT = UsagePointers(
    "/usage/input_tokens",
    "/usage/output_tokens",
    ("/usage/cache_creation_input_tokens", "/usage/cache_read_input_tokens"),
)
BUILT_IN_POINTERS = (OPENAI_CHAT, INPUT_OUTPUT)


def check_pointer(pointer: str) -> str:
    if pointer and not pointer.startswith("/"):
        raise ValueError(f"a JSON pointer starts with '/', not {pointer!r} (RFC 6901)")
    return pointer


def resolve(document: Any, pointer: str) -> Any:
    """The value `pointer` names in `document` (RFC 6901), or None when it names nothing."""
    if not pointer:
        return document
    value = document
    for raw in pointer[1:].split("/"):
        token = raw.replace("~1", "/").replace("~0", "~")  # RFC 6901 §4: in this order
        if isinstance(value, Mapping):
            value = value.get(token)
        elif isinstance(value, list) and token.isascii() and token.isdigit():
            index = int(token)
            value = value[index] if index < len(value) else None
        else:
            return None
    return value


def extract_usage(
    body: Any, pointers: Sequence[UsagePointers] = BUILT_IN_POINTERS
) -> tuple[int, int] | None:
    """(input, output) tokens from a parsed answer, by the first pointers that name both."""
    for where in pointers:
        input_tokens, output_tokens = (
            _count(resolve(body, where.input)),
            _count(resolve(body, where.output)),
        )
        if input_tokens is None or output_tokens is None:
            continue
        for extra in where.extra_input:
            input_tokens += _count(resolve(body, extra)) or 0
        return input_tokens, output_tokens
    return None


def _count(value: object) -> int | None:
    """A token count: a non-negative integer (JSON has no int type: 12.0 is 12; true is not)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    return None


def request_model(item: Item) -> str | None:
    return _model(item.body)


def answer_model(body: Any) -> str | None:
    return _model(body)


def _model(body: Any) -> str | None:
    model = body.get("model") if isinstance(body, Mapping) else None
    return model if isinstance(model, str) and model else None


@dataclass(frozen=True)
class Estimate:
    """An item's tokens before it is sent: `output_tokens` is None when nothing caps them."""

    input_tokens: int
    output_tokens: int | None

    def tokens(self, assumed_output: int = 0) -> int:
        output = self.output_tokens if self.output_tokens is not None else assumed_output
        return self.input_tokens + output


@dataclass(frozen=True)
class WorstCase:
    """The most an item sent without an answer may have used (a result line's `worst_case`):
    counted against a budget until an answer for its key says what it used. `output_tokens` is
    None when nothing capped the answer (neither the request nor `--assume-max-output`)."""

    input_tokens: int
    output_tokens: int | None
    model: str | None = None

    def to_json(self) -> dict[str, Any]:
        output = self.output_tokens
        total = None if output is None else self.input_tokens + output
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": output,
            "total_tokens": total,
            "model": self.model,
        }

    @classmethod
    def from_json(cls, value: object) -> WorstCase | None:
        """A result line's `worst_case`; None for a line that has none (or one we did not write)."""
        if not isinstance(value, Mapping):
            return None
        input_tokens, output = _count(value.get("input_tokens")), value.get("output_tokens")
        if input_tokens is None or (output is not None and _count(output) is None):
            return None
        model = value.get("model")
        return cls(input_tokens, _count(output), model if isinstance(model, str) else None)


def worst_case(item: Item, assumed_output: int | None) -> WorstCase:
    """What the item may use at most: its prompt's bound and the most its answer may hold."""
    output = output_limit(item.body)
    if output is None and assumed_output is not None:
        output = assumed_output * choices(item.body)
    return WorstCase(prompt_bound(item), output, request_model(item))


def prompt_bound(item: Item) -> int:
    """The most tokens the request's prompt may count: one per byte of its body (a byte-level
    BPE token is at least one byte; the body's JSON pays for a chat template's tokens)."""
    data, _ = item.payload()
    return len(data) if data else 0


def estimate(item: Item) -> Estimate:
    data, _ = item.payload()
    input_tokens = math.ceil(len(data) / BYTES_PER_TOKEN) if data else 0
    return Estimate(input_tokens, output_limit(item.body))


def output_limit(body: Any) -> int | None:
    """The most output tokens the answer may bill: the cap of one choice times the choices."""
    if not isinstance(body, Mapping):
        return None
    limits = [_count(body.get(name)) for name in OUTPUT_LIMIT_FIELDS]
    known = [limit for limit in limits if limit is not None]
    return max(known) * choices(body) if known else None


def choices(body: Any) -> int:
    """How many answers one request generates and bills: OpenAI's `n` (chat and completions),
    or its completions' `best_of`, each capped by `max_tokens` on its own; else one."""
    if not isinstance(body, Mapping):
        return 1
    counts = [_count(body.get(name)) for name in CHOICE_FIELDS]
    return max([1, *(count for count in counts if count)])


def with_usage(
    record: ResultRecord,
    item: Item,
    pointers: Sequence[UsagePointers] = BUILT_IN_POINTERS,
    worst: WorstCase | None = None,
) -> ResultRecord:
    """The record with the usage its answer reports: a JSON body's, or a stream's events'.

    An answer of the execution that reports none (a stream without usage, a body that is not
    JSON) was paid all the same: it keeps `worst`, the item's worst case, as its `worst_case`,
    counted against a budget in place of the usage it did not say (SPEC §14) — if the answer
    was capped (else it has no worst case: an API that bills no tokens, with no budget).
    """
    tokens = reported_usage(record.body, record.body_encoding, record.content_type, pointers)
    if tokens is None:
        return _at_worst(record, worst)
    model = request_model(item) or answer_model(record.body)
    return replace(record, usage=Usage(*tokens, model).to_json())


def _at_worst(record: ResultRecord, worst: WorstCase | None) -> ResultRecord:
    if worst is None or worst.output_tokens is None or record.worst_case is not None:
        return record
    executed = record.outcome in (Outcome.DONE, Outcome.OMITTED)
    return replace(record, worst_case=worst.to_json()) if executed else record


def reported_usage(
    body: Any, encoding: str, content_type: str | None, pointers: Sequence[UsagePointers]
) -> tuple[int, int] | None:
    """(input, output) tokens an answer kept as `encode_body` keeps it reports, if any."""
    if encoding == "json":
        return extract_usage(body, pointers)
    if encoding == "text" and is_event_stream(content_type):
        for document in usage_documents(body):
            tokens = extract_usage(document, pointers)
            if tokens is not None:
                return tokens
    return None


def answer_tokens(
    body: bytes, content_type: str | None, pointers: Sequence[UsagePointers]
) -> int | None:
    """The total tokens a raw answer reports (for correcting a rate limit's estimate)."""
    parsed, encoding = encode_body(body, content_type)
    tokens = reported_usage(parsed, encoding, content_type, pointers)
    return None if tokens is None else sum(tokens)
