"""config/llm-gateway.yaml and its contract (config/contracts/chat.*) work together: the schema is
valid, the samples load, and a real OpenAI-compatible answer honours the contract (SPEC §3.4)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from idemproxy.config.settings import load_settings
from idemproxy.proxy.routing import Route, RouteTable
from idemproxy.proxy.upstream.contract import Contract

ROOT = Path(__file__).parents[2]
COMPLETION = {
    "id": "chatcmpl-9x",
    "object": "chat.completion",
    "created": 1733000000,
    "model": "chat-default",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "ok"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
}


@pytest.fixture
def chat_route(monkeypatch: pytest.MonkeyPatch) -> Route:
    monkeypatch.chdir(ROOT)  # the example's contract paths are relative to the repository
    for variable in [name for name in os.environ if name.startswith("IDEMPROXY_")]:
        monkeypatch.delenv(variable)
    for variable in ("OPENAI_API_KEY", "FALLBACK_API_KEY"):  # the providers' keys it reads
        monkeypatch.setenv(variable, f"{variable.lower()}-from-a-secret")
    settings = load_settings(ROOT / "config" / "llm-gateway.yaml")
    route = RouteTable.from_settings(settings).find("/v1/chat/completions", None)
    assert route is not None
    return route


def test_the_chat_route_is_a_hedged_group_with_a_contract(chat_route: Route) -> None:
    assert chat_route.prefix == "/v1/chat/completions"
    assert chat_route.fallbacks and chat_route.hedge_after is not None
    assert chat_route.gate is not None
    assert chat_route.gate.fallbacks == chat_route.fallbacks
    assert chat_route.gate.eligible == ()  # until the fallback has passed its check
    assert chat_route.upstreams == (chat_route.upstream,)


def test_each_provider_gets_its_own_key_and_the_chat_route_its_timeout(chat_route: Route) -> None:
    """The gateway holds the providers' keys: each upstream of the group replaces the client's
    Authorization with its own (config/upstream.py), samples included."""
    keys = {
        url: {name: value for edit in edits for name, value in edit.set}["Authorization"]
        for url, edits in chat_route.header_edits.items()
    }
    assert keys == {
        chat_route.upstream: "Bearer openai_api_key-from-a-secret",
        chat_route.fallbacks[0]: "Bearer fallback_api_key-from-a-secret",
    }
    assert chat_route.gate is not None and chat_route.gate.edits == chat_route.header_edits
    assert chat_route.upstream_timeout == 120


def test_every_sample_is_a_chat_request_for_the_same_model(chat_route: Route) -> None:
    assert chat_route.gate is not None
    samples = chat_route.gate.contract.samples
    assert len(samples) >= 1
    for sample in samples:
        assert (sample.method, sample.path) == ("POST", "/v1/chat/completions")
        body = json.loads(sample.body)
        assert body["model"] == "chat-default"
        assert body["messages"] and body["max_tokens"] <= 64


def test_a_chat_completion_honours_the_contract(chat_route: Route) -> None:
    assert chat_route.gate is not None
    contract: Contract = chat_route.gate.contract
    assert contract.violations(200, json.dumps(COMPLETION).encode()) == []
    # Errors are not checked: the status decides (SPEC §3.2).
    assert contract.violations(429, b'{"error": {"type": "rate_limit"}}') == []


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"choices": []}, "/choices"),
        ({"object": "text_completion"}, "/object"),
        ({"id": None}, "/id"),
        ({"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}, "/choices/0"),
    ],
)
def test_a_completion_of_another_shape_violates_the_contract(
    chat_route: Route, change: dict[str, object], where: str
) -> None:
    assert chat_route.gate is not None
    body = json.dumps(COMPLETION | change).encode()
    [violation] = chat_route.gate.contract.violations(200, body)
    assert violation.startswith(f"{where}: "), violation


def test_a_streamed_completion_violates_the_contract(chat_route: Route) -> None:
    assert chat_route.gate is not None
    events = b'data: {"id": "chatcmpl-9x", "object": "chat.completion.chunk"}\n\ndata: [DONE]\n\n'
    assert chat_route.gate.contract.violations(200, events) == ["body is not JSON"]


def test_each_provider_receives_its_own_name_as_host(chat_route: Route) -> None:
    """SPEC §10: TLS and a CDN in front of a provider name the provider; the client's Host
    (this gateway's name) would be refused (421, 403)."""
    assert chat_route.forward_host == "upstream"
