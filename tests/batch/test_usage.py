"""Pure: the tokens an answer reports (OpenAI, Anthropic, JSON pointers), a request's estimate."""

from __future__ import annotations

from typing import Any

import pytest

from idemproxy.batch.input import Item
from idemproxy.batch.records import Outcome
from idemproxy.batch.usage import (
    BUILT_IN_POINTERS,
    Estimate,
    Usage,
    UsagePointers,
    WorstCase,
    answer_tokens,
    check_pointer,
    estimate,
    extract_usage,
    resolve,
    with_usage,
    worst_case,
)

from .factory import record

OPENAI_CHAT = {
    "id": "chatcmpl-1",
    "model": "gpt-4o-mini-2024-07-18",
    "choices": [{"message": {"role": "assistant", "content": "Q1"}}],
    "usage": {"prompt_tokens": 31, "completion_tokens": 12, "total_tokens": 43},
}
ANTHROPIC = {
    "id": "msg_1",
    "type": "message",
    "model": "claude-3-5-haiku-20241022",
    "content": [{"type": "text", "text": "Q1"}],
    "usage": {
        "input_tokens": 20,
        "output_tokens": 7,
        "cache_creation_input_tokens": 100,
        "cache_read_input_tokens": 5,
    },
}


def test_openai_chat_usage() -> None:
    assert extract_usage(OPENAI_CHAT) == (31, 12)


def test_anthropic_usage_counts_cache_tokens_as_input() -> None:
    assert extract_usage(ANTHROPIC) == (125, 7)
    plain = {"usage": {"input_tokens": 20, "output_tokens": 7}}  # OpenAI responses API too
    assert extract_usage(plain) == (20, 7)


@pytest.mark.parametrize(
    "body",
    [
        None,
        "text",
        [1, 2],
        {"usage": None},
        {"usage": {"prompt_tokens": 3}},  # one count alone is not usage
        {"usage": {"prompt_tokens": True, "completion_tokens": 1}},
        {"usage": {"prompt_tokens": -1, "completion_tokens": 1}},
        {"usage": {"prompt_tokens": "3", "completion_tokens": 1}},
        {"usage": {"prompt_tokens": 1.5, "completion_tokens": 1}},
    ],
)
def test_no_usage(body: Any) -> None:
    assert extract_usage(body) is None


def test_integral_floats_are_counts() -> None:
    assert extract_usage({"usage": {"prompt_tokens": 3.0, "completion_tokens": 4}}) == (3, 4)


def test_custom_pointers_come_first_and_follow_rfc6901() -> None:
    body = {
        "meta": {"a/b": [{"in~": 5, "out": 6}]},
        "usage": {"input_tokens": 1, "output_tokens": 1},
    }
    pointers = (UsagePointers("/meta/a~1b/0/in~0", "/meta/a~1b/0/out"), *BUILT_IN_POINTERS)
    assert extract_usage(body, pointers) == (5, 6)
    assert resolve(body, "/meta/a~1b/1") is None and resolve(body, "/meta/x/y") is None
    assert resolve(body, "") is body
    with pytest.raises(ValueError, match="starts with '/'"):
        check_pointer("meta/in")


def test_a_record_gets_the_usage_and_the_request_model() -> None:
    item = Item("q1", "POST", "/v1/chat/completions", body={"model": "gpt-4o-mini"})
    done = with_usage(record(item, body=OPENAI_CHAT), item)
    assert done.usage == {
        "input_tokens": 31,
        "output_tokens": 12,
        "total_tokens": 43,
        "model": "gpt-4o-mini",
    }
    unnamed = Item("q2", "POST", "/v1/messages", body={"max_tokens": 5})
    assert with_usage(record(unnamed, body=ANTHROPIC), unnamed).usage["model"] == (
        "claude-3-5-haiku-20241022"  # the answer's, when the request names none
    )
    as_text = record(item, body='{"usage": {}}', body_encoding="text")
    assert with_usage(as_text, item).usage is None
    failed = record(item, Outcome.FAILED, body={"error": "bad"})
    assert with_usage(failed, item).usage is None


def test_usage_read_back_from_a_line() -> None:
    usage = Usage(3, 4, "m")
    assert Usage.from_json(usage.to_json()) == usage and usage.total_tokens == 7
    assert Usage.from_json({"input_tokens": 3}) is None and Usage.from_json("x") is None


def test_answer_tokens_for_the_rate_limit() -> None:
    body = b'{"usage": {"prompt_tokens": 2, "completion_tokens": 3}}'
    assert answer_tokens(body, "application/json", BUILT_IN_POINTERS) == 5
    assert answer_tokens(body, "text/plain", BUILT_IN_POINTERS) is None
    assert answer_tokens(b"{nope", "application/json", BUILT_IN_POINTERS) is None


def test_the_estimate_is_body_bytes_over_four_plus_the_output_cap() -> None:
    body = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "x" * 40}]}
    item = Item("a", "POST", "/v1/chat/completions", body=body)
    size = len(item.payload()[0] or b"")
    assert estimate(item) == Estimate(-(-size // 4), 100)
    assert estimate(item).tokens() == -(-size // 4) + 100
    both = Item("b", "POST", "/x", body={"max_tokens": 10, "max_output_tokens": 30})
    assert estimate(both).output_tokens == 30
    uncapped = Item("c", "POST", "/x", body={"prompt": "hi"})
    assert estimate(uncapped).output_tokens is None
    assert estimate(uncapped).tokens(assumed_output=50) == estimate(uncapped).input_tokens + 50
    assert estimate(Item("d", "GET", "/x")) == Estimate(0, None)


@pytest.mark.parametrize("text", ["x" * 40, "漢" * 900, "🙂 é " * 50, '\n\t"' * 10])
def test_the_worst_case_counts_the_prompt_at_a_token_per_byte_of_the_body(text: str) -> None:
    # A byte-level BPE token is at least one byte of the text: the body's bytes bound the
    # prompt's tokens, where 4 bytes a token does not (a CJK character is 3 bytes, often 1 token).
    body = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": text}]}
    item = Item("a", "POST", "/v1/chat/completions", body=body)
    size = len(item.payload()[0] or b"")
    assert worst_case(item, None) == WorstCase(size, 100, "m")
    assert size >= len(text.encode()) + 24 >= len(text) + 24
    assert worst_case(Item("b", "POST", "/x", body={"prompt": "hi"}), 7).output_tokens == 7
    assert worst_case(Item("d", "GET", "/x"), None) == WorstCase(0, None)


@pytest.mark.parametrize(
    ("body", "worst_output"),
    [
        ({"max_tokens": 100, "n": 8}, 800),  # OpenAI: each of the n choices up to max_tokens
        ({"max_completion_tokens": 50, "n": 3}, 150),
        ({"max_tokens": 100, "best_of": 5, "n": 2}, 500),  # completions: best_of generated
        ({"max_tokens": 100, "n": 1}, 100),
        ({"max_tokens": 100, "n": 0}, 100),
        ({"max_tokens": 100, "n": True}, 100),  # not a count
        ({"max_tokens": 100}, 100),
    ],
)
def test_every_choice_an_answer_bills_is_in_its_worst_case(
    body: dict[str, Any], worst_output: int
) -> None:
    """A budget counted `max_tokens` once for `n` choices: a run spent several budgets."""
    item = Item("a", "POST", "/v1/chat/completions", body={"model": "m", **body})
    assert worst_case(item, None).output_tokens == worst_output
    assert estimate(item).output_tokens == worst_output


def test_an_assumed_output_counts_every_choice_too() -> None:
    item = Item("a", "POST", "/v1/chat/completions", body={"model": "m", "n": 4})
    assert worst_case(item, 25).output_tokens == 100
