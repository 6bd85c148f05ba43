"""The results file: appended line by line, fsynced, torn last line repaired (SPEC §14)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from idemproxy.batch.checkpoint import CheckpointWriter, TornLine, read_checkpoint
from idemproxy.batch.errors import (
    BatchError,
    CheckpointCorrupt,
    CheckpointLocked,
    CheckpointUnwritable,
)
from idemproxy.batch.records import Outcome, ResultRecord, encode_body

from .factory import record


def _write(path: Path, *records: ResultRecord) -> None:
    writer, _ = CheckpointWriter.open(path)
    try:
        for one in records:
            writer.append(one)
    finally:
        writer.close()


def test_each_result_is_one_self_describing_line(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    _write(path, record("a"), record("b", Outcome.FAILED))
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 3
    first = json.loads(lines[0])
    assert first["v"] == 1 and first["id"] == "a" and first["outcome"] == "done"
    assert set(first) >= {"status", "body", "attempts", "replayed", "started_at", "finished_at"}


def test_a_record_survives_the_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    original = record("a", meta={"chapter": "ü"}, replayed=True, attempts=3)
    _write(path, original)
    assert read_checkpoint(path).records == {"a": original}


def test_a_later_line_for_the_same_id_wins(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    _write(path, record("a", Outcome.FAILED), record("b"), record("a"))
    checkpoint = read_checkpoint(path)
    assert checkpoint.lines == 3 and checkpoint.records["a"].outcome is Outcome.DONE


def test_reopening_appends(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    _write(path, record("a"))
    _write(path, record("b"))
    assert list(read_checkpoint(path).records) == ["a", "b"]


def test_a_torn_last_line_is_cut_off_when_opened_for_writing(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    _write(path, record("a"), record("b"))
    whole = path.read_bytes()
    torn = whole[: len(whole) - 40]  # died in the middle of writing b's line
    path.write_bytes(torn)
    assert read_checkpoint(path).torn == TornLine(2, len(torn) - whole.index(b"\n") - 1)
    assert path.read_bytes() == torn  # reading alone changes nothing
    writer, checkpoint = CheckpointWriter.open(path)
    writer.close()
    assert list(checkpoint.records) == ["a"] and checkpoint.torn is not None
    assert path.read_bytes() == whole[: whole.index(b"\n") + 1]
    _write(path, record("b"))
    assert read_checkpoint(path).torn is None and len(read_checkpoint(path).records) == 2


def test_a_whole_last_result_without_its_newline_is_kept_and_completed(tmp_path: Path) -> None:
    # A result is fsynced with its newline in one write; one that lacks only the newline is
    # still the whole record: it is kept, and given its newline before anything is appended.
    path = tmp_path / "out.jsonl"
    whole = record("a").to_line() + record("b").to_line()
    path.write_bytes(whole[:-1])
    assert read_checkpoint(path).unterminated == 2
    writer, checkpoint = CheckpointWriter.open(path)
    writer.close()
    assert list(checkpoint.records) == ["a", "b"] and checkpoint.torn is None
    assert checkpoint.unterminated == 2 and path.read_bytes() == whole
    _write(path, record("c"))
    assert list(read_checkpoint(path).records) == ["a", "b", "c"]


@pytest.mark.parametrize("cut", [1, 5, 11, 12, 60])
def test_any_strict_prefix_of_a_result_is_a_torn_line(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "out.jsonl"
    first = record("a").to_line()
    path.write_bytes(first + record("b").to_line()[:cut])
    writer, checkpoint = CheckpointWriter.open(path)
    writer.close()
    assert checkpoint.torn == TornLine(2, cut) and path.read_bytes() == first


@pytest.mark.parametrize(
    "data",
    [
        b'{"report": {"total": 3}}',  # --output pointing at an unrelated JSON file
        b'{"report": {"total": 3}',
        b"id,amount\n1,2\n",  # not JSON at all, with newlines
        b"plain words",
        record("a").to_line() + b'{"unrelated": true}',
        record("a").to_line() + b'{"v":1,"id":"x"}',  # whole JSON that is not a result
    ],
)
def test_a_file_that_is_not_a_results_file_is_left_alone(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "report.json"
    path.write_bytes(data)
    with pytest.raises(CheckpointCorrupt, match="is not"):
        CheckpointWriter.open(path)
    assert path.read_bytes() == data


@pytest.mark.parametrize("garbage", [b"{oops\n", b'{"id": "x"}\n', b"[1]\n"])
def test_a_bad_line_before_the_last_is_corruption(tmp_path: Path, garbage: bytes) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(record("a").to_line() + garbage + record("b").to_line())
    with pytest.raises(CheckpointCorrupt, match="line 2 is not a result"):
        CheckpointWriter.open(path)
    with pytest.raises(CheckpointCorrupt):
        read_checkpoint(path)


def test_a_results_file_that_cannot_be_opened_is_a_batch_error(tmp_path: Path) -> None:
    with pytest.raises(BatchError, match=r"cannot open .*No such file"):
        CheckpointWriter.open(tmp_path / "absent" / "out.jsonl")


def test_only_one_run_writes_a_results_file(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    writer, _ = CheckpointWriter.open(path)
    try:
        with pytest.raises(CheckpointLocked, match="another batch run"):
            CheckpointWriter.open(path)
    finally:
        writer.close()
    CheckpointWriter.open(path)[0].close()


def test_a_missing_file_is_an_empty_checkpoint(tmp_path: Path) -> None:
    checkpoint = read_checkpoint(tmp_path / "absent.jsonl")
    assert checkpoint.records == {} and checkpoint.lines == 0 and checkpoint.torn is None


@pytest.mark.parametrize(
    ("data", "content_type", "expected"),
    [
        (b'{"a": 1}', "application/json; charset=utf-8", ({"a": 1}, "json")),
        (b'{"a": 1}', "application/problem+json", ({"a": 1}, "json")),
        (b"{broken", "application/json", ("{broken", "text")),
        (b"hello", "text/plain", ("hello", "text")),
        (b"\xff\x00", "application/octet-stream", ("/wA=", "base64")),
        (b"", "application/json", (None, "none")),
    ],
)
def test_answer_bodies_are_kept_as_json_text_or_base64(
    data: bytes, content_type: str, expected: tuple[object, str]
) -> None:
    assert encode_body(data, content_type) == expected


def test_a_failed_write_is_reported_as_such(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    writer, _ = CheckpointWriter.open(tmp_path / "out.jsonl")
    monkeypatch.setattr(os, "fsync", no_space)
    try:
        with pytest.raises(CheckpointUnwritable, match="No space left on device; rerun"):
            writer.append(record("a"))
    finally:
        writer.close()


@pytest.mark.parametrize("body", [float("nan"), float("inf"), "caf\ud83d", {"x": float("-inf")}])
def test_a_record_strict_json_cannot_carry_is_refused_not_written(body: object) -> None:
    with pytest.raises(ValueError):
        record("a", body=body).to_line()


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b'{"text":"caf\\ud83d"}', ('{"text":"caf\\ud83d"}', "text")),
        (b"[NaN]", ("[NaN]", "text")),
        (b"1e999", ("1e999", "text")),
        (b"[" * 100_000 + b"]" * 100_000, (("[" * 100_000 + "]" * 100_000), "text")),
        (b'"\xed\xa0\xbd"', ("Iu2gvSI=", "base64")),  # a surrogate encoded as UTF-8 bytes
    ],
)
def test_json_bodies_that_cannot_be_written_back_are_kept_as_they_came(
    data: bytes, expected: tuple[object, str]
) -> None:
    assert encode_body(data, "application/json") == expected
