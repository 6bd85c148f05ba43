"""Pure: the usage a streamed answer's events report (OpenAI, Anthropic), read like a body's."""

from __future__ import annotations

import json
from typing import Any

import pytest

from idemproxy.batch.input import Item
from idemproxy.batch.records import Outcome
from idemproxy.batch.stream import is_event_stream
from idemproxy.batch.usage import (
    BUILT_IN_POINTERS,
    UsagePointers,
    WorstCase,
    answer_tokens,
    reported_usage,
    with_usage,
)

from .factory import record


def _sse(*events: Any, end: str = "\n") -> str:
    """Events as an API streams them: `event:` lines where given, `data:`, a blank line."""
    text = ""
    for event in events:
        name, data = event if isinstance(event, tuple) else (None, event)
        data = data if isinstance(data, str) else json.dumps(data)
        text += (f"event: {name}{end}" if name else "") + f"data: {data}{end}{end}"
    return text


def _chunk(content: str) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"delta": {"content": content}}],
            "usage": None}  # fmt: skip


OPENAI_STREAM = _sse(
    _chunk("A "), _chunk("question."),
    {"object": "chat.completion.chunk", "choices": [],
     "usage": {"prompt_tokens": 31, "completion_tokens": 12, "total_tokens": 43}},
    "[DONE]",
)  # fmt: skip
ANTHROPIC_STREAM = _sse(
    ("message_start", {"type": "message_start", "message": {"id": "msg_1", "usage": {
        "input_tokens": 20, "output_tokens": 1, "cache_read_input_tokens": 5}}}),
    ("content_block_delta", {"type": "content_block_delta", "delta": {"text": "Q1"}}),
    ("ping", {"type": "ping"}),
    ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                       "usage": {"output_tokens": 7}}),
    ("message_stop", {"type": "message_stop"}),
)  # fmt: skip
RESPONSES_STREAM = _sse(
    ("response.created", {"type": "response.created", "response": {"usage": None}}),
    ("response.completed", {"type": "response.completed", "response": {
        "usage": {"input_tokens": 9, "output_tokens": 4, "total_tokens": 13}}}),
)  # fmt: skip


def _usage(text: str) -> tuple[int, int] | None:
    return reported_usage(text, "text", "text/event-stream; charset=utf-8", BUILT_IN_POINTERS)


def test_openai_chat_streams_say_their_usage_in_the_last_chunk() -> None:
    assert _usage(OPENAI_STREAM) == (31, 12)


def test_anthropic_streams_start_with_the_input_and_end_with_the_output() -> None:
    # message_delta's output is cumulative: it replaces message_start's 1.
    assert _usage(ANTHROPIC_STREAM) == (25, 7)
    assert _usage(ANTHROPIC_STREAM.replace("\n", "\r\n")) == (25, 7)
    assert _usage(ANTHROPIC_STREAM.replace("\n", "\r")) == (25, 7)


def test_openai_responses_streams_say_it_when_completed() -> None:
    assert _usage(RESPONSES_STREAM) == (9, 4)


@pytest.mark.parametrize(
    "text",
    [
        _sse(_chunk("A "), _chunk("question."), "[DONE]"),  # no stream_options.include_usage
        _sse(("message_delta", {"type": "message_delta", "usage": {"output_tokens": 7}})),
        ": a comment\n\ndata: {not json\n\ndata: 12\n\n",
        "",
    ],
)
def test_a_stream_without_usage_reports_none(text: str) -> None:
    assert _usage(text) is None


def test_data_over_several_lines_is_one_event_and_the_last_event_that_says_wins() -> None:
    text = OPENAI_STREAM + 'data: {"meta": {"in": 3,\ndata: "out": 4}}\n\n'
    pointers = (UsagePointers("/meta/in", "/meta/out"), *BUILT_IN_POINTERS)
    assert reported_usage(text, "text", "text/event-stream", pointers) == (3, 4)
    assert _usage(text) == (31, 12)


def test_only_an_event_stream_is_read_as_one() -> None:
    assert is_event_stream("Text/Event-Stream ; charset=utf-8")
    assert not is_event_stream("text/plain") and not is_event_stream(None)
    assert reported_usage(OPENAI_STREAM, "text", "text/plain", BUILT_IN_POINTERS) is None
    data = OPENAI_STREAM.encode()
    assert answer_tokens(data, "text/event-stream", BUILT_IN_POINTERS) == 43  # for --tpm


def test_an_answer_without_usage_keeps_the_worst_case() -> None:
    item = Item("q1", "POST", "/v1/chat/completions", body={"model": "m", "max_tokens": 9})
    worst = WorstCase(30, 9, "m")
    streamed = record(item, body=OPENAI_STREAM, body_encoding="text",
                      content_type="text/event-stream")  # fmt: skip
    read = with_usage(streamed, item, BUILT_IN_POINTERS, worst)
    assert read.usage == {"input_tokens": 31, "output_tokens": 12, "total_tokens": 43,
                          "model": "m"} and read.worst_case is None  # fmt: skip
    plain = record(item, body="A question.", body_encoding="text", content_type="text/plain")
    assert with_usage(plain, item, BUILT_IN_POINTERS, worst).worst_case == worst.to_json()
    omitted = record(item, Outcome.OMITTED, body=None, body_encoding="none")
    assert with_usage(omitted, item, BUILT_IN_POINTERS, worst).worst_case == worst.to_json()
    # The upstream's own failure without usage was not paid; without a worst case, as it was.
    failed = record(item, Outcome.FAILED, body="overloaded", body_encoding="text")
    assert with_usage(failed, item, BUILT_IN_POINTERS, worst).worst_case is None
    assert with_usage(plain, item).worst_case is None
    uncapped = WorstCase(30, None, "m")  # no max_tokens, no --assume-max-output: not known
    assert with_usage(plain, item, BUILT_IN_POINTERS, uncapped).worst_case is None


def test_a_stream_cut_off_says_no_usage() -> None:
    """What an unfinished stream said is not what it used: an Anthropic stream ended by an
    `error` event after its text, or never past `message_start` (whose output count is a
    placeholder), reports none, and the budget counts the item at its worst case."""
    start = ANTHROPIC_STREAM.split("event: content_block_delta")[0]
    text = start + _sse(
        ("content_block_delta", {"type": "content_block_delta", "delta": {"text": "x " * 500}}),
        ("error", {"type": "error", "error": {"type": "overloaded_error"}}),
    )
    assert _usage(text) is None
    assert _usage(start) is None
    errored = OPENAI_STREAM.replace("[DONE]", json.dumps({"type": "error"}))
    assert _usage(errored) is None
