"""`idemproxy batch export --failed`: the input lines of failed and unknown items, as they are."""

from __future__ import annotations

from pathlib import Path

import pytest

from idemproxy.batch.checkpoint import CheckpointWriter
from idemproxy.batch.input import Item, read_input
from idemproxy.batch.records import Outcome
from idemproxy.cli.main import main

from .factory import record

# Written by hand, as people do: spacing and key order that a JSON writer would not keep.
LINES = [
    b'{"id": "a", "method": "POST", "path": "/x", "body": {"n": 1}}',
    b'{"body": {"n": 2},  "id": "b", "method": "POST", "path": "/x"}',
    b'{"id": "c", "method": "POST", "path": "/x", "body": {"n": 3}}',
    b'{"id": "d", "method": "POST", "path": "/x", "body": {"n": 4}}',
    b"",
    b'{"id": "e", "method": "POST", "path": "/x", "body": {"n": 5}}',
    b'{"id": "f", "method": "POST", "path": "/x", "body": {"n": 6}}',
    b'{"id": "g", "method": "POST", "path": "/x", "body": {"n": 7}}',
]


def _files(tmp_path: Path) -> tuple[Path, Path]:
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"\n".join(LINES) + b"\n")
    items = {item.id: item for item in read_input(source).items}
    out = tmp_path / "out.jsonl"
    writer, _ = CheckpointWriter.open(out)
    writer.append(record(items["a"]))
    writer.append(record(items["b"], Outcome.FAILED, retryable=True))
    writer.append(record(items["c"], Outcome.UNKNOWN))
    writer.append(record(items["d"], Outcome.OMITTED, replayed=True))
    writer.append(record(items["e"], Outcome.FAILED))
    writer.append(record(Item("f", "POST", "/x", body={"n": 0}), Outcome.FAILED))  # edited since
    writer.close()  # "g": no result yet
    return source, out


def test_failed_and_unknown_items_come_out_as_their_input_lines(
    tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    source, out = _files(tmp_path)
    assert main(["batch", "export", str(out), "--input", str(source), "--failed"]) == 0
    captured = capsysbinary.readouterr()
    assert captured.out == LINES[1] + b"\n" + LINES[2] + b"\n" + LINES[5] + b"\n"
    err = captured.err.decode()
    assert "exported 3 item(s): 2 failed, 1 unknown" in err
    assert "left out 1 omitted (executed once and paid for" in err
    assert "1 without a result yet" in err and "1 changed since their result was written" in err


def test_exported_lines_are_the_same_items_under_the_same_keys(
    tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    source, out = _files(tmp_path)
    main(["batch", "export", str(out), "--input", str(source), "--failed"])
    retry = tmp_path / "retry.jsonl"
    retry.write_bytes(capsysbinary.readouterr().out)
    exported = read_input(retry).items
    originals = {item.id: item for item in read_input(source).items}
    assert [item.id for item in exported] == ["b", "c", "e"]
    assert all(item.body == originals[item.id].body for item in exported)


def test_export_needs_the_input_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, out = _files(tmp_path)
    with pytest.raises(SystemExit):
        main(["batch", "export", str(out), "--failed"])
    assert "--input" in capsys.readouterr().err
    assert main(["batch", "export", str(out), "--input", str(tmp_path / "no.jsonl"),
                 "--failed"]) == 2  # fmt: skip
