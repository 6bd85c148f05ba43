"""Answers no well-behaved API gives, and each still ends in one result line (issue: a body
Python parses but cannot write back crashed the run at the same item on every resume).

The upstream is raw bytes (rawserver.py), straight behind the runner; test_end_to_end.py and
test_fuzz.py put the real proxy in between.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from idemproxy.batch import BatchOptions, run_batch
from idemproxy.batch import client as batch_client
from idemproxy.batch import records as batch_records

from .rawserver import RawAnswer, RawUpstream, raw_upstream

JSON = b"Content-Type: application/json"
HOSTILE = {
    "/surrogate": RawAnswer(201, (JSON,), b'{"text":"caf\\ud83d"}'),
    "/deep": RawAnswer(200, (JSON,), b"[" * 100_000 + b"]" * 100_000),
    "/deep-500": RawAnswer(200, (JSON,), b"[" * 500 + b"]" * 500),  # the encoder writes it
    "/nan": RawAnswer(200, (JSON,), b'{"score": NaN, "big": 1e999}'),
    "/infinity": RawAnswer(200, (JSON,), b"[Infinity, -Infinity]"),
    "/huge-int": RawAnswer(200, (JSON,), b"1" * 5000),
    "/bytes": RawAnswer(200, (JSON,), b'{"a": "\xff\xfe"}'),
    "/binary": RawAnswer(200, (b"Content-Type: application/octet-stream",), bytes(range(256))),
    "/header-bytes": RawAnswer(200, (b"Content-Type: text/\xff\xfeplain",), b"hello"),
    "/error-bytes": RawAnswer(422, (b"Idempotency-Error: \xc3\x28bad",), b"no"),
    "/retry-after": RawAnswer(503, (b"Retry-After: \xc2\xb2",), b""),
    "/empty-json": RawAnswer(200, (JSON,), b""),
}


def strict_line(line: bytes) -> dict[str, Any]:
    """Parse as a strict parser would: UTF-8 with no lone surrogates, no NaN or Infinity."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} in a results line")

    text = line.decode("utf-8")  # strict: refuses encoded surrogates too
    value: dict[str, Any] = json.loads(text, parse_constant=refuse)
    json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")  # no lone surrogate
    return value


def strict_results(path: Path) -> list[dict[str, Any]]:
    data = path.read_bytes()
    assert data.endswith(b"\n")
    return [strict_line(line) for line in data.splitlines()]


def _items(paths: list[str]) -> list[dict[str, Any]]:
    return [{"id": path.strip("/"), "method": "POST", "path": path} for path in paths]


def _options(url: str) -> BatchOptions:
    return BatchOptions(target=url, retries=1, backoff_base=0.001, backoff_max=0.01, timeout=10)


async def test_every_answer_gets_a_line_that_strict_parsers_read(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    async with raw_upstream(RawUpstream(dict(HOSTILE))) as (upstream, url):
        summary = await run_batch(_items(list(HOSTILE)), out, _options(url))
    results = {r["id"]: r for r in strict_results(out)}
    assert sorted(results) == sorted(path.strip("/") for path in HOSTILE)
    for name in ("surrogate", "nan", "infinity", "huge-int", "deep"):
        assert results[name]["outcome"] == "done" and results[name]["body_encoding"] == "text"
    assert results["surrogate"]["body"] == '{"text":"caf\\ud83d"}'
    assert (
        results["deep-500"]["outcome"] == "done" and results["deep-500"]["body_encoding"] == "json"
    )
    assert results["bytes"]["body_encoding"] == "base64"
    assert results["binary"]["body_encoding"] == "base64"
    assert results["header-bytes"]["content_type"] == "text/\ufffd\ufffdplain"
    assert results["error-bytes"]["outcome"] == "failed"
    assert results["retry-after"]["retryable"] and results["retry-after"]["attempts"] == 2
    assert results["empty-json"]["body_encoding"] == "none"
    assert summary.done == 10 and summary.failed == 2
    assert all(upstream.calls[path] == 1 for path in HOSTILE if path != "/retry-after")


async def test_a_record_that_cannot_be_made_is_a_failed_item_and_the_batch_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whatever raises while one answer is turned into its record (a bug, or an answer nothing
    # here foresaw) fails that item, not the run, and not the items in flight beside it.
    real = batch_records.encode_body  # what batch_client calls

    def breaks_on_boom(data: bytes, content_type: str | None) -> tuple[Any, str]:
        if b"boom" in data:
            raise RecursionError("maximum recursion depth exceeded")
        return real(data, content_type)

    monkeypatch.setattr(batch_client, "encode_body", breaks_on_boom)
    answers = {f"/ok{n}": RawAnswer(200, (JSON,), b'{"ok": %d}' % n) for n in range(6)}
    answers["/boom"] = RawAnswer(200, (JSON,), b'"boom"')
    out = tmp_path / "out.jsonl"
    async with raw_upstream(RawUpstream(answers)) as (_, url):
        summary = await run_batch(_items(list(answers)), out, _options(url))
    results = {r["id"]: r for r in strict_results(out)}
    assert len(results) == 7 and summary.done == 6 and summary.failed == 1
    boom = results["boom"]
    assert boom["outcome"] == "failed" and not boom["retryable"]
    assert boom["error"] == (
        "the answer could not be recorded: RecursionError: maximum recursion depth exceeded"
    )
