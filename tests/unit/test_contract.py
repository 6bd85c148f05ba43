"""A group's response contract (SPEC §3.4): loading the schema and samples, judging a body.

Configuration mistakes fail at start-up with a message that names the field (SPEC §12).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from idemproxy.config.settings import ContractSettings
from idemproxy.errors import ConfigError
from idemproxy.proxy.upstream.contract import Contract, load_samples
from tests.support.named_upstream import CHAT_SCHEMA


def contract(tmp_path: Path, schema: str | None = None, samples: str | None = None) -> Contract:
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(CHAT_SCHEMA) if schema is None else schema)
    samples_file = tmp_path / "samples.jsonl"
    samples_file.write_text('{"path": "/v1/chat"}\n' if samples is None else samples)
    return Contract(ContractSettings(schema_file=schema_file, samples_file=samples_file))


def test_samples_default_to_post_and_send_json_or_text_bodies(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    path.write_text(
        '{"path": "/v1/chat", "body": {"prompt": "hi"}}\n'
        "\n"
        '{"method": "put", "path": "/v1/raw", "headers": {"X-Test": 1}, "body": "as is"}\n'
        '{"method": "DELETE", "path": "/v1/none"}\n'
    )
    first, second, third = load_samples(path)
    assert (first.method, first.path, first.headers) == ("POST", "/v1/chat", {})
    assert json.loads(first.body) == {"prompt": "hi"}
    assert (second.method, second.headers, second.body) == ("PUT", {"X-Test": "1"}, b"as is")
    assert (third.method, third.body) == ("DELETE", b"")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"path": "/ok"}\n{not json\n', "contract.samples_file line 2: "),
        ('{"method": "POST"}\n', "contract.samples_file line 1: "),
        ("\n\n", "holds no samples"),
    ],
    ids=["not-json", "no-path", "empty"],
)
def test_a_bad_samples_file_is_a_config_error_naming_the_line(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        contract(tmp_path, samples=text)


@pytest.mark.parametrize(
    "schema",
    ['{"type": 12}', "{not json", "12"],
    ids=["invalid-schema", "not-json", "not-an-object"],
)
def test_a_bad_schema_file_is_a_config_error_naming_the_field(tmp_path: Path, schema: str) -> None:
    with pytest.raises(ConfigError, match=r"^contract\.schema_file .*schema\.json: "):
        contract(tmp_path, schema=schema)


def test_a_missing_file_is_refused_by_the_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        ContractSettings(schema_file=tmp_path / "nope.json", samples_file=tmp_path / "x.jsonl")


def test_violations_of_a_2xx_body(tmp_path: Path) -> None:
    rules = contract(tmp_path)
    good = {"id": "a", "choices": [{"text": "hi"}]}
    assert rules.violations(200, json.dumps(good).encode()) == []
    assert rules.violations(201, b"[]") == ["/: [] is not of type 'object'"]
    assert rules.violations(200, b"<html/>") == ["body is not JSON"]
    assert rules.violations(200, None) == ["body too large to check against the contract"]
    # Only 2xx bodies are judged; other statuses are classified as usual (SPEC §3.2).
    assert rules.violations(503, b"<html/>") == []


def test_at_most_five_violations_are_reported(tmp_path: Path) -> None:
    rules = contract(tmp_path)
    body = {"id": 1, "choices": [{"text": n} for n in range(10)]}
    assert len(rules.violations(200, json.dumps(body).encode())) == 5


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 10_000 + b"]" * 10_000,  # too deep for the parser
        b"[" * 400 + b"]" * 400,  # too deep for jsonschema, which validates recursively
    ],
)
def test_a_body_too_deep_to_check_is_a_violation_not_a_crash(tmp_path: Path, body: bytes) -> None:
    """A valid JSON body deeper than the recursion limit raised RecursionError out of the
    attempt; it cannot be judged, so it is a breach (SPEC §3.4: the upstream acted)."""
    arrays = {"type": "array", "items": {"$ref": "#/$defs/n"}}
    nested = {"$defs": {"n": arrays}, "$ref": "#/$defs/n"}
    rules = contract(tmp_path, schema=json.dumps(nested))
    assert rules.violations(200, b"[[[]]]") == []
    assert rules.violations(200, body) == [
        "body is nested too deeply to check against the contract"
    ]
