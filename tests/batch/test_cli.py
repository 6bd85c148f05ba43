"""`idemproxy batch …` wiring: exit codes and messages that need no network (SPEC §13, §14).

Runs that send are exercised as real processes in test_end_to_end.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from idemproxy.batch.checkpoint import CheckpointWriter
from idemproxy.batch.input import Item
from idemproxy.batch.records import Outcome
from idemproxy.cli.main import main

from .factory import record
from .servers import write_jsonl

ITEMS: list[dict[str, Any]] = [
    {"id": f"i{n}", "method": "POST", "path": "/x", "body": {"id": f"i{n}"}} for n in range(4)
]


def _run(tmp_path: Path, source: Path, *extra: str) -> int:
    out = tmp_path / "out.jsonl"
    return main(["batch", "run", str(source), "--target", "http://127.0.0.1:9",
                 "--output", str(out), *extra])  # fmt: skip


def test_invalid_input_refuses_to_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": "a", "method": "POST", "path": "/x"}\n{"method": "POST"}\nnope\n')
    assert _run(tmp_path, source) == 2
    err = capsys.readouterr().err
    assert "2 invalid input line(s)" in err
    assert 'line 2: missing "id"' in err and "line 3: not valid JSON" in err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--header", "no colon"], "--header must be 'Name: value'"),
        (["--header-env", "Authorization=BATCH_TEST_UNSET_VAR"], "BATCH_TEST_UNSET_VAR is not set"),
        (["--header-env", "Authorization"], "--header-env must be NAME=VARIABLE"),
        (["--key-prefix", "a,b"], "key prefix"),
        (["--concurrency", "0"], "concurrency must be"),
        (["--max-cost", "5"], "--max-cost needs a price table"),
        (["--max-tokens", "-1"], "must be ≥ 0"),
        (["--rpm", "0"], "--rpm and --tpm must be > 0"),
        (["--usage-pointers", "/a"], "--usage-pointers: expected INPUT,OUTPUT"),
        (["--usage-pointers", "a,/b"], "starts with '/'"),
        (["--prices", "/nonexistent/prices.yaml"], "cannot read the price table"),
        # The items set no max_tokens: their worst case is unknown.
        (["--max-tokens", "1000"], "give --assume-max-output N"),
    ],
)
def test_bad_flags_refuse_to_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", ITEMS)
    assert _run(tmp_path, source, *flags) == 2
    assert message in capsys.readouterr().err


def _results(tmp_path: Path) -> Path:
    out = tmp_path / "out.jsonl"
    items = [Item(o["id"], "POST", "/x", body=o["body"]) for o in ITEMS]
    writer, _ = CheckpointWriter.open(out)
    writer.append(record(items[0], replayed=True))
    writer.append(record(items[1], Outcome.FAILED, retryable=True))
    writer.append(record(Item("gone", "POST", "/x"), Outcome.UNKNOWN))
    writer.close()
    with out.open("ab") as sink:
        sink.write(b'{"v":1,"id":"i2","outc')  # torn
    return out


def test_status_reports_without_sending(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _results(tmp_path)
    source = write_jsonl(tmp_path / "in.jsonl", ITEMS)
    assert main(["batch", "status", str(out), "--input", str(source)]) == 0
    text = capsys.readouterr().out
    assert "torn last line 4" in text and "done     1 (1 replayed)" in text
    assert "failed   1 (1 retried on rerun)" in text and "pending  2" in text
    assert main(["batch", "status", str(out), "--input", str(source), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["items"], status["done"], status["pending"], status["extra"]) == (4, 1, 2, 1)
    assert status["unknown"] == 0 and status["changed"] == 0


def test_status_without_input_counts_the_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _results(tmp_path)
    assert main(["batch", "status", str(out), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["done"], status["failed"], status["unknown"]) == (1, 1, 1)
    assert status["pending"] is None


def test_status_of_a_corrupt_file_says_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text("garbage\n" + record("a").to_line().decode())
    assert main(["batch", "status", str(out)]) == 2
    assert "line 1 is not a result" in capsys.readouterr().err


def test_status_counts_and_explains_omitted_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.jsonl"
    writer, _ = CheckpointWriter.open(out)
    writer.append(record("a"))
    writer.append(record("b", Outcome.OMITTED, body=None, body_encoding="none", replayed=True))
    writer.close()
    assert main(["batch", "status", str(out)]) == 0
    text = capsys.readouterr().out
    assert "done     1 (0 replayed)" in text
    assert "omitted  1 (executed once, but the proxy kept no body" in text
    assert "max_stored_body" in text
    assert main(["batch", "status", str(out), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["done"], status["omitted"], status["unknown"]) == (1, 1, 0)


def test_a_file_that_is_not_a_results_file_refuses_to_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "report.json"
    report.write_bytes(b'{"total": 3, "rows": []}')
    source = write_jsonl(tmp_path / "in.jsonl", ITEMS)
    assert main(["batch", "run", str(source), "--target", "http://127.0.0.1:9",
                 "--output", str(report)]) == 2  # fmt: skip
    assert "is not a result nor the start of one" in capsys.readouterr().err
    assert report.read_bytes() == b'{"total": 3, "rows": []}'


def test_status_totals_the_tokens_and_their_cost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.jsonl"
    usage = {"input_tokens": 600_000, "output_tokens": 100_000, "total_tokens": 700_000}
    writer, _ = CheckpointWriter.open(out)
    writer.append(record("a", usage={**usage, "model": "gpt-4o-mini-2024-07-18"}))
    writer.append(record("b", replayed=True, usage={**usage, "model": "gpt-4o-mini"}))
    writer.append(record("c"))  # an answer without usage
    writer.close()
    prices = tmp_path / "prices.yaml"
    prices.write_text("models:\n  gpt-4o-mini: {input: 0.15, output: 0.60}\n")
    assert main(["batch", "status", str(out), "--prices", str(prices)]) == 0
    text = capsys.readouterr().out
    assert (
        "tokens   executed 1 answer(s), 700,000 tokens (in 600,000, out 100,000), 0.150000 USD"
        in text
    )
    assert "replayed 1 answer(s), 700,000 tokens" in text and "and not again" in text
    assert "1 done answer(s) without usage" in text
    assert main(["batch", "status", str(out), "--prices", str(prices), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)["usage"]
    assert status["executed"]["cost"] == 0.15 and status["cost"] == 0.3
    assert status["total_tokens"] == 1_400_000 and status["currency"] == "USD"


def test_status_of_an_api_that_reports_no_usage_shows_no_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _results(tmp_path)
    assert main(["batch", "status", str(out)]) == 0
    assert "tokens" not in capsys.readouterr().out


def test_status_totals_the_last_run_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.jsonl"
    usage = {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15, "model": "m"}
    writer, _ = CheckpointWriter.open(out)
    writer.append(record("a", usage=usage, run="2025-01-01T00:00:00.000Z"))
    writer.append(record("b", usage=usage, run="2025-01-02T00:00:00.000Z"))
    writer.append(record("c", usage=usage, run="2025-01-02T00:00:00.000Z", replayed=True))
    writer.close()
    assert main(["batch", "status", str(out), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (
        status["usage"]["total_tokens"] == 45 and status["last_run"] == "2025-01-02T00:00:00.000Z"
    )
    assert status["last_run_usage"]["executed"]["total_tokens"] == 15
    assert status["last_run_usage"]["replayed"]["total_tokens"] == 15
    assert main(["batch", "status", str(out)]) == 0
    text = capsys.readouterr().out
    assert "last run (started 2025-01-02T00:00:00.000Z): executed 1 answer(s), 15 tokens" in text
