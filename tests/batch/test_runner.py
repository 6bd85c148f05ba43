"""`run_batch` against a scripted API: keys, retries, resume, failures, stops (SPEC §14).

These run in-process and fast; test_end_to_end.py puts the real proxy in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest

from idemproxy.batch import (
    BatchOptions,
    CheckpointCorrupt,
    CheckpointLocked,
    CheckpointUnwritable,
    InvalidInput,
    KeyHeaderChanged,
    KeyPrefixChanged,
    Outcome,
    ResultRecord,
    Stop,
    run_batch,
)
from idemproxy.batch.checkpoint import CheckpointWriter
from tests.support.ports import free_port

from .scripted import Calls
from .servers import read_results


def _options(url: str, **overrides: Any) -> BatchOptions:
    fast = {"concurrency": 4, "backoff_base": 0.001, "backoff_max": 0.01, "timeout": 5.0}
    return BatchOptions(**{"target": url, **fast, **overrides})


def _items(count: int, path: str = "/things", **extra: Any) -> list[dict[str, Any]]:
    return [
        {"id": f"i{n}", "method": "POST", "path": path, "body": {"n": n}, **extra}
        for n in range(count)
    ]


class Recorder:
    """A reporter that keeps what it was told, and can act on each result."""

    def __init__(self, on_advance: Any = None) -> None:
        self.notes: list[str] = []
        self.records: list[ResultRecord] = []
        self.on_advance = on_advance

    def start(self, total: int, completed: int) -> None:
        self.notes.append(f"start {completed}/{total}")

    def advance(self, record: ResultRecord) -> None:
        self.records.append(record)
        if self.on_advance:
            self.on_advance(len(self.records))

    def note(self, message: str) -> None:
        self.notes.append(message)

    def finish(self) -> None:
        self.notes.append("finish")


async def test_every_item_gets_one_line_under_its_own_key(
    api_url: str, calls: Calls, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    summary = await run_batch(_items(20), out, _options(api_url))
    results = read_results(out)
    assert sorted(r["id"] for r in results) == sorted(f"i{n}" for n in range(20))
    assert all(r["outcome"] == "done" and r["status"] == 201 for r in results)
    assert all(r["body"]["key"] == r["key"] for r in results)
    assert sorted(calls.by_key) == sorted(r["key"] for r in results)
    assert set(calls.by_key.values()) == {1}
    assert summary.complete and summary.done == 20 and summary.skipped == 0


async def test_a_rerun_skips_what_is_already_answered(
    api_url: str, calls: Calls, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    await run_batch(_items(10), out, _options(api_url))
    summary = await run_batch(_items(12), out, _options(api_url))
    assert (summary.skipped, summary.done, summary.sent) == (10, 2, 2)
    assert sum(calls.by_key.values()) == 12 and len(read_results(out)) == 12


@pytest.mark.parametrize(
    "script",
    [
        "status=503",
        "status=429",
        "status=502",
        "status=504",
        "status=408",
        "status=409",
        "status=409&code=request-in-flight",
    ],
)
async def test_transient_answers_are_retried_under_the_same_key(
    api_url: str, calls: Calls, tmp_path: Path, script: str
) -> None:
    out = tmp_path / "out.jsonl"
    summary = await run_batch(_items(1, f"/x?fail=2&{script}"), out, _options(api_url))
    [result] = read_results(out)
    assert result["outcome"] == "done" and result["attempts"] == 3
    assert dict(calls.by_key) == {result["key"]: 3}
    assert summary.complete


async def test_a_held_duplicate_ends_in_a_replay(
    api_url: str, calls: Calls, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    path = "/x?fail=1&status=409&code=request-in-flight&replay=1"
    summary = await run_batch(_items(1, path), out, _options(api_url))
    [result] = read_results(out)
    assert result["replayed"] is True and result["attempts"] == 2
    # The execution it was held behind is this key's, and paid: answered late, not free.
    assert summary.answered_late == 1 and summary.done == 1


async def test_outcome_unknown_is_recorded_not_retried(
    api_url: str, calls: Calls, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    items = _items(1, "/x?fail=9&status=409&code=outcome-unknown")
    summary = await run_batch(items, out, _options(api_url))
    [result] = read_results(out)
    assert result["outcome"] == "unknown" and result["attempts"] == 1
    assert result["error_code"] == "outcome-unknown" and result["status"] == 409
    assert summary.unknown == 1 and not summary.complete
    again = await run_batch(items, out, _options(api_url))
    assert (again.sent, again.earlier_unknown, sum(calls.by_key.values())) == (0, 1, 1)
    await run_batch(items, out, _options(api_url, retry_unknown=True))
    assert sum(calls.by_key.values()) == 2


async def test_permanent_failures_are_not_retried_unless_asked(
    api_url: str, calls: Calls, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    items = _items(1, "/x?fail=1&status=422")
    summary = await run_batch(items, out, _options(api_url))
    [result] = read_results(out)
    assert result["outcome"] == "failed" and result["attempts"] == 1
    assert result["retryable"] is False and result["body"] == {"failed": True}
    assert summary.failed == 1 and not summary.complete
    again = await run_batch(items, out, _options(api_url))
    assert again.sent == 0 and sum(calls.by_key.values()) == 1
    retried = await run_batch(items, out, _options(api_url, retry_failed=True))
    assert retried.done == 1 and retried.complete
    assert [r["outcome"] for r in read_results(out)] == ["failed", "done"]


async def test_when_retries_run_out_the_item_is_retried_on_the_next_run(
    api_url: str, calls: Calls, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    items = _items(1, "/x?fail=3&status=503")
    summary = await run_batch(items, out, _options(api_url, retries=1))
    [result] = read_results(out)
    assert result["outcome"] == "failed" and result["retryable"] is True
    assert result["attempts"] == 2 and summary.retryable == 1
    again = await run_batch(items, out, _options(api_url, retries=1))
    assert again.done == 1 and len(set(calls.by_key)) == 1


async def test_a_refused_connection_is_transient(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    target = f"http://127.0.0.1:{free_port()}"
    summary = await run_batch(_items(2), out, _options(target, retries=2))
    results = read_results(out)
    assert all(r["outcome"] == "failed" and r["retryable"] for r in results)
    assert all(r["status"] is None and r["attempts"] == 3 for r in results)
    assert all("Connect" in r["error"] for r in results)
    assert summary.retryable == 2


async def test_a_timeout_is_retried(api_url: str, calls: Calls, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    await run_batch(_items(1, "/x?slow=1&delay=2"), out, _options(api_url, timeout=0.5))
    [result] = read_results(out)
    assert result["outcome"] == "done" and result["attempts"] == 2
    assert dict(calls.by_key) == {result["key"]: 2}


async def test_run_headers_are_sent_and_never_written(
    api_url: str, calls: Calls, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    items = _items(3, headers={"X-Item": "yes"}, meta={"chapter": 4})
    headers = {"Authorization": "Bearer sk-very-secret"}
    await run_batch(items, out, _options(api_url, headers=headers))
    assert all(h["Authorization"] == "Bearer sk-very-secret" for h in calls.headers)
    assert all(
        h["X-Item"] == "yes" and h["Content-Type"] == "application/json" for h in calls.headers
    )
    assert "sk-very-secret" not in out.read_text()
    assert sorted(calls.bodies) == sorted(
        json.dumps({"n": n}).replace(" ", "").encode() for n in range(3)
    )
    assert all(r["meta"] == {"chapter": 4} for r in read_results(out))


async def test_a_changed_item_is_reported_not_replayed(
    api_url: str, calls: Calls, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    items = _items(3)
    await run_batch(items, out, _options(api_url))
    items[1]["body"] = {"n": 1, "edited": True}
    recorder = Recorder()
    summary = await run_batch(items, out, _options(api_url), reporter=recorder)
    assert summary.changed == 1 and summary.sent == 0 and not summary.complete
    assert any("'i1' (line 2) changed" in note for note in recorder.notes)
    assert sum(calls.by_key.values()) == 3
    rerun = await run_batch(items, out, _options(api_url, rerun_changed=True))
    assert rerun.done == 1 and rerun.complete
    old, new = [r for r in read_results(out) if r["id"] == "i1"]
    assert old["key"] != new["key"] and calls.by_key[new["key"]] == 1


async def test_another_key_prefix_on_resume_is_refused(api_url: str, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    await run_batch(_items(2), out, _options(api_url, key_prefix="first"))
    with pytest.raises(KeyPrefixChanged, match="'first'"):
        await run_batch(_items(3), out, _options(api_url, key_prefix="second"))


async def _killed_before_any_answer(api_url: str, calls: Calls, out: Path, **keys: Any) -> None:
    """A run whose items are all sent and none answered when it dies: no result line."""
    run = asyncio.create_task(run_batch(_items(3, "/x?delay=5"), out, _options(api_url, **keys)))
    deadline = asyncio.get_running_loop().time() + 5
    while sum(calls.by_key.values()) < 3:
        assert asyncio.get_running_loop().time() < deadline, "the items were never sent"
        await asyncio.sleep(0.01)
    run.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await run
    assert read_results(out) == []


@pytest.mark.parametrize(
    ("changed", "refused"),
    [
        ({"key_prefix": "second"}, KeyPrefixChanged),
        ({"key_header": "X-Key"}, KeyHeaderChanged),
    ],
    ids=["prefix", "header"],
)
async def test_other_keys_after_a_run_stopped_before_its_first_answer_are_refused(
    api_url: str, calls: Calls, tmp_path: Path, changed: dict[str, str], refused: type
) -> None:
    """Its results file is empty, its items in flight: under other keys they ran twice."""
    out = tmp_path / "out.jsonl"
    await _killed_before_any_answer(api_url, calls, out, key_prefix="first")
    sent = sum(calls.by_key.values())
    with pytest.raises(refused):
        keys = {"key_prefix": "first", **changed}
        await run_batch(_items(3, "/x?delay=5"), out, _options(api_url, **keys))
    assert sum(calls.by_key.values()) == sent  # nothing was sent again


async def test_a_link_to_the_results_names_the_same_keys(
    api_url: str, calls: Calls, tmp_path: Path
) -> None:
    """Reviewed: killed through a symbolic link, resumed through the file's own name."""
    out = tmp_path / "out.jsonl"
    link = tmp_path / "link.jsonl"
    link.symlink_to(out)
    await _killed_before_any_answer(api_url, calls, link, key_prefix="first")
    with pytest.raises(KeyPrefixChanged):
        await run_batch(_items(3, "/x?delay=5"), out, _options(api_url, key_prefix="second"))


@pytest.mark.parametrize("content", [b"", b"{", b"[]", b'{"prefix": 1, "header": "h"}'])
async def test_keys_that_cannot_be_read_stop_the_run(
    api_url: str, calls: Calls, tmp_path: Path, content: bytes
) -> None:
    out = tmp_path / "out.jsonl"
    await _killed_before_any_answer(api_url, calls, out, key_prefix="first")
    out.with_name(out.name + ".keys").write_bytes(content)
    sent = sum(calls.by_key.values())
    with pytest.raises(CheckpointCorrupt, match="which keys"):
        await run_batch(_items(3, "/x?delay=5"), out, _options(api_url, key_prefix="second"))
    assert sum(calls.by_key.values()) == sent


async def test_results_of_items_not_in_this_input_still_name_the_prefix(
    api_url: str, tmp_path: Path
) -> None:
    """A run answered `i0` and `i1` under `first` and had `i2` in flight: resuming `i2` alone
    under `second` would run it twice."""
    out = tmp_path / "out.jsonl"
    await run_batch(_items(2), out, _options(api_url, key_prefix="first"))
    (out.with_name(out.name + ".keys")).unlink()  # as a results file of an older version
    with pytest.raises(KeyPrefixChanged, match="'first'"):
        await run_batch(_items(3)[2:], out, _options(api_url, key_prefix="second"))


async def test_a_graceful_stop_lets_items_in_flight_finish(
    api_url: str, calls: Calls, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    stop = Stop()
    recorder = Recorder(on_advance=lambda n: stop.request() if n == 5 else None)
    items = _items(40, "/x?delay=0.02")
    summary = await run_batch(items, out, _options(api_url), reporter=recorder, stop=stop)
    results = read_results(out)
    assert summary.stopped and summary.interrupted == 40 - len(results)
    assert 5 <= len(results) < 40
    assert sum(calls.by_key.values()) == len(results)  # nothing in flight was dropped
    resumed = await run_batch(items, out, _options(api_url))
    assert resumed.complete and resumed.skipped == len(results)
    assert len(read_results(out)) == 40 and set(calls.by_key.values()) == {1}


async def test_a_second_stop_abandons_items_in_flight(
    api_url: str, calls: Calls, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    stop = Stop()
    items = _items(4, "/x?delay=5&slow=1") + _items(8)[4:]  # the first four hang

    async def press_twice() -> None:
        await calls.reached(4)
        stop.request()
        stop.request()

    presser = asyncio.create_task(press_twice())
    summary = await asyncio.wait_for(run_batch(items, out, _options(api_url), stop=stop), 3)
    await presser
    assert summary.stopped and summary.interrupted == 8 and out.read_bytes() == b""
    resumed = await run_batch(items, out, _options(api_url))
    assert resumed.complete and len(read_results(out)) == 8


async def test_concurrent_results_never_interleave(api_url: str, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    summary = await run_batch(_items(150, "/x?size=20000"), out, _options(api_url, concurrency=16))
    lines = out.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 151
    assert {json.loads(line)["id"] for line in lines[:-1]} == {f"i{n}" for n in range(150)}
    assert summary.done == 150


async def test_invalid_input_sends_nothing_and_writes_nothing(
    api_url: str, calls: Calls, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    items = [*_items(2), {"method": "POST", "path": "/x"}]
    with pytest.raises(InvalidInput, match='line 3: missing "id"'):
        await run_batch(items, out, _options(api_url))
    assert not out.exists() and not calls.by_key
    summary = await run_batch(items, out, _options(api_url, skip_invalid=True))
    assert summary.invalid == 1 and summary.done == 2 and summary.complete


async def test_one_results_file_one_run(api_url: str, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    writer, _ = CheckpointWriter.open(out)
    try:
        with pytest.raises(CheckpointLocked):
            await run_batch(_items(1), out, _options(api_url))
    finally:
        writer.close()


async def test_a_results_file_that_cannot_be_written_stops_the_run(
    api_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def io_error(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    out = tmp_path / "out.jsonl"
    out.touch()
    monkeypatch.setattr(os, "fsync", io_error)
    with pytest.raises(CheckpointUnwritable, match="Input/output error"):
        await run_batch(_items(10), out, _options(api_url))


@pytest.mark.parametrize(
    "overrides",
    [
        {"target": "ftp://x"},
        {"concurrency": 0},
        {"key_prefix": "a,b"},
        {"timeout": 0},
        {"key_header": "Idempotency Key"},
        {"headers": {"Authorization": "Bearer \x01"}},
        {"headers": {"Authorization": "Bearer x\r\nX-Evil: 1"}},
        {"headers": {"Bad Name": "x"}},
    ],
)
async def test_bad_options_are_refused(tmp_path: Path, overrides: dict[str, Any]) -> None:
    from idemproxy.batch import BatchError

    options = _options("http://127.0.0.1:1", **overrides)
    with pytest.raises(BatchError):
        await run_batch(_items(1), tmp_path / "out.jsonl", options)


def test_outcomes_are_the_documented_words() -> None:
    assert [o.value for o in Outcome] == ["done", "failed", "unknown", "omitted"]


async def test_a_replay_without_its_body_is_omitted_never_done(
    api_url: str, calls: Calls, tmp_path: Path
) -> None:
    # The first answer was lost (the connection dropped, the run was killed); the retry under
    # the same key is the proxy's replay of a response it did not store (SPEC §7).
    out = tmp_path / "out.jsonl"
    items = _items(2, "/x?omit=1")
    items[1]["path"] = "/x?omit=1&slow=1&delay=2"  # the first try times out
    summary = await run_batch(items, out, _options(api_url, timeout=0.5))
    results = {r["id"]: r for r in read_results(out)}
    assert results["i0"]["outcome"] == "done" and results["i0"]["body"]["call"] == 1
    omitted = results["i1"]
    assert omitted["outcome"] == "omitted" and omitted["body"] is None
    assert omitted["replayed"] and omitted["status"] == 201 and not omitted["retryable"]
    assert "did not store the answer" in omitted["error"]
    assert (summary.done, summary.omitted) == (1, 1) and not summary.complete
    assert "omitted 1" in summary.describe() and "max_stored_body" in summary.describe()
    # A rerun cannot get the body back: the item is not sent again, and still not complete.
    recorder = Recorder()
    again = await run_batch(items, out, _options(api_url), reporter=recorder)
    assert (again.sent, again.earlier_omitted, again.complete) == (0, 1, False)
    assert any("1 item(s) are 'omitted'" in note for note in recorder.notes)
    assert sum(calls.by_key.values()) == 3
    asked = await run_batch(items, out, _options(api_url, retry_omitted=True))
    assert asked.omitted == 1 and sum(calls.by_key.values()) == 4  # the same key, replayed


async def test_a_replayed_409_is_a_final_answer(api_url: str, calls: Calls, tmp_path: Path) -> None:
    # A plain 409 from the upstream is stored by the proxy and replayed as it is: asking again
    # can never change it, so it is not retried for ever (run after run) as `retryable`.
    out = tmp_path / "out.jsonl"
    items = _items(1, "/x?fail=99&status=409&replayed=1")
    summary = await run_batch(items, out, _options(api_url))
    [result] = read_results(out)
    assert result["outcome"] == "failed" and result["status"] == 409
    assert result["attempts"] == 2 and not result["retryable"] and result["replayed"]
    assert summary.failed == 1 and summary.retryable == 0
    again = await run_batch(items, out, _options(api_url))
    assert again.sent == 0 and sum(calls.by_key.values()) == 2


async def test_a_stop_ends_a_retry_backoff_at_once(
    api_url: str, calls: Calls, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    stop = Stop()
    items = _items(2, "/x?fail=9&status=503&after=300")  # Retry-After: 5 minutes

    async def press_once() -> None:
        await calls.reached(2)
        await asyncio.sleep(0.05)  # both are in their backoff
        stop.request()

    presser = asyncio.create_task(press_once())
    summary = await asyncio.wait_for(run_batch(items, out, _options(api_url), stop=stop), 3)
    await presser
    results = read_results(out)
    assert summary.stopped and len(results) == 2
    assert all(r["outcome"] == "failed" and r["retryable"] and r["status"] == 503 for r in results)
    assert sum(calls.by_key.values()) == 2


async def test_another_key_header_on_resume_is_refused(
    api_url: str, calls: Calls, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    await run_batch(_items(2), out, _options(api_url, key_header="Idempotency-Key"))
    assert {r["key_header"] for r in read_results(out)} == {"Idempotency-Key"}
    with pytest.raises(KeyHeaderChanged, match="--key-header 'Idempotency-Key', not 'X-Key'"):
        await run_batch(_items(3), out, _options(api_url, key_header="X-Key"))
    assert sum(calls.by_key.values()) == 2  # nothing was sent
    resumed = await run_batch(_items(3), out, _options(api_url, key_header="idempotency-key"))
    assert resumed.done == 1 and resumed.complete  # header names are case-insensitive
