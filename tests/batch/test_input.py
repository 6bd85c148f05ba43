"""The input file is validated as a whole, with line numbers, before anything is sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from idemproxy.batch.errors import InvalidInput
from idemproxy.batch.input import Item, items_from_objects, read_input


def _write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_valid_lines_become_items(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '{"id": "a", "method": "post", "path": "/v1/x", "headers": {"X-T": "1"}, "body": {"k": 1}}',
        "",
        '{"id": 7, "method": "GET", "path": "/v1/y?q=1", "meta": {"chapter": 2}}',
    )
    items = read_input(path).items
    assert [item.id for item in items] == ["a", "7"]
    assert items[0].method == "POST" and items[0].headers == (("X-T", "1"),)
    assert items[1].line == 3 and items[1].meta == {"chapter": 2} and items[1].body is None


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"method": "POST", "path": "/x"}', 'missing "id"'),
        ('{"id": true, "method": "POST", "path": "/x"}', '"id" must be'),
        ('{"id": "", "method": "POST", "path": "/x"}', '"id" must be'),
        ('{"id": "a", "path": "/x"}', '"method"'),
        ('{"id": "a", "method": "POST", "path": "x"}', '"path"'),
        ('{"id": "a", "method": "POST", "path": "/x y"}', '"path"'),
        ('{"id": "a", "method": "POST", "path": "/x", "bdy": 1}', "unknown field(s) 'bdy'"),
        ('{"id": "a", "method": "POST", "path": "/x", "headers": {"A": 1}}', '"headers"'),
        ('{"id": "a", "method": "POST", "path": "/x", "body": NaN}', "NaN"),
        (
            '{"id": "a", "method": "POST", "path": "/x", "headers": {"idempotency-key": "k"}}',
            "derived by the runner",
        ),
    ],
)
def test_invalid_lines_are_reported_with_their_number(
    tmp_path: Path, line: str, reason: str
) -> None:
    path = _write(tmp_path, '{"id": "ok", "method": "POST", "path": "/x"}', line)
    with pytest.raises(InvalidInput) as caught:
        read_input(path)
    assert caught.value.problems == [caught.value.problems[0]]
    assert caught.value.problems[0].startswith("line 2: ")
    assert reason in caught.value.problems[0]
    assert "--skip-invalid" in str(caught.value)


def test_every_invalid_line_is_listed(tmp_path: Path) -> None:
    path = _write(tmp_path, "x", '{"id": "a", "method": "POST", "path": "/x"}', "y", "z")
    with pytest.raises(InvalidInput) as caught:
        read_input(path)
    assert [p.split(":")[0] for p in caught.value.problems] == ["line 1", "line 3", "line 4"]


def test_skip_invalid_leaves_them_out_and_says_which(tmp_path: Path) -> None:
    path = _write(tmp_path, "x", '{"id": "a", "method": "POST", "path": "/x"}')
    source = read_input(path, skip_invalid=True)
    assert [item.id for item in source.items] == ["a"]
    assert source.invalid == ["line 1: not valid JSON (Expecting value at column 1)"]


@pytest.mark.parametrize("skip_invalid", [False, True])
def test_duplicate_ids_are_always_an_error(tmp_path: Path, skip_invalid: bool) -> None:
    line = '{"id": "a", "method": "POST", "path": "/x"}'
    path = _write(tmp_path, line, '{"id": "b", "method": "POST", "path": "/x"}', line)
    with pytest.raises(InvalidInput, match=r"line 3: duplicate id 'a' \(first on line 1\)"):
        read_input(path, skip_invalid=skip_invalid)


def test_integer_and_string_ids_that_read_the_same_are_duplicates() -> None:
    with pytest.raises(InvalidInput, match="duplicate id '1'"):
        items_from_objects(
            [{"id": 1, "method": "POST", "path": "/x"}, {"id": "1", "method": "POST", "path": "/x"}]
        )


def test_missing_file_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="No such file"):
        read_input(tmp_path / "absent.jsonl")


def test_json_bodies_are_sent_canonical() -> None:
    item = Item("a", "POST", "/x", body={"b": [1, 2], "a": "é"})
    assert item.payload() == (json.dumps({"a": "é", "b": [1, 2]}, ensure_ascii=False,
                              separators=(",", ":")).encode(), "application/json")  # fmt: skip


def test_a_string_body_with_a_text_content_type_is_sent_as_text() -> None:
    item = Item("a", "POST", "/x", headers=(("content-type", "text/plain"),), body="hi there")
    assert item.payload() == (b"hi there", "text/plain")
    as_json = Item("a", "POST", "/x", headers=(("Content-Type", "application/vnd+json"),), body="x")
    assert as_json.payload() == (b'"x"', "application/vnd+json")


def test_no_body_sends_nothing() -> None:
    assert Item("a", "DELETE", "/x").payload() == (None, None)


A = '{"id": "a", "method": "POST", "path": "/x", '  # an item line, to be completed
DEEP = A + '"body": ' + "[" * 100_000 + "]" * 100_000 + "}"


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (A + '"body": {"t": "caf\\ud83d"}}', '"body" has a lone surrogate'),
        (A + '"meta": ["\\udc00"]}', '"meta" has a lone surrogate'),
        ('{"id": "caf\\ud83d", "method": "POST", "path": "/x"}', '"id" has a lone surrogate'),
        (A + '"headers": {"X-A": "b\\u0000c"}}', "control character"),
        (A + '"headers": {"X-A": "b\\u001bc"}}', "control character"),
        (A + '"headers": {"X-A": "b\\u007f"}}', "control character"),
        (A + '"headers": {"X-A": "\\ud800"}}', "control character"),
        (A + '"body": 1e999}', "strict JSON"),
        (DEEP, "nested too deep"),
    ],
)  # fmt: skip
def test_what_could_not_be_sent_or_written_is_refused_with_its_line(
    tmp_path: Path, line: str, reason: str
) -> None:
    path = _write(tmp_path, '{"id": "ok", "method": "POST", "path": "/x"}', line)
    with pytest.raises(InvalidInput) as caught:
        read_input(path)
    [problem] = caught.value.problems
    assert problem.startswith("line 2: ") and reason in problem


def test_a_tab_in_a_header_value_is_fine(tmp_path: Path) -> None:
    path = _write(
        tmp_path, '{"id": "a", "method": "POST", "path": "/x", "headers": {"X": "a\\tb é"}}'
    )
    assert read_input(path).items[0].headers == (("X", "a\tb é"),)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (float("nan"), "strict JSON"),
        ({"a": {1, 2}}, "strict JSON"),
        ({"t": "caf\ud83d"}, "lone surrogate"),
        ({(1, 2): "tuple key"}, "strict JSON"),
    ],
)
def test_python_items_are_held_to_the_same_rules(body: object, reason: str) -> None:
    with pytest.raises(InvalidInput, match=f"line 1: .*{reason}"):
        items_from_objects([{"id": "a", "method": "POST", "path": "/x", "body": body}])


def test_a_python_header_name_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(InvalidInput, match=r"line 1: .*must be a header name"):
        items_from_objects([{"id": "a", "method": "POST", "path": "/x", "headers": {1: "x"}}])
