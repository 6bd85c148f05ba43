"""Keys are deterministic per item and change exactly when the intent changes (SPEC §4, §14)."""

from __future__ import annotations

import dataclasses

import pytest

from idemproxy.batch.input import Item
from idemproxy.batch.keys import check_prefix, identify, prefix_of
from idemproxy.identity.intent import parse_key

ITEM = Item("q-1", "POST", "/v1/chat", headers=(("X-Model", "m"),), body={"a": 1, "b": 2})


def test_the_same_item_always_gets_the_same_key() -> None:
    again = Item("q-1", "POST", "/v1/chat", headers=(("x-model", "m"),), body={"b": 2, "a": 1})
    assert identify(ITEM, "batch") == identify(again, "batch")
    assert identify(ITEM, "batch").key.startswith("batch:q-1:")


@pytest.mark.parametrize(
    "edit",
    [
        {"body": {"a": 1, "b": 3}},
        {"method": "PUT"},
        {"path": "/v1/chat?x=1"},
        {"headers": (("X-Model", "other"),)},
        {"body": None},
    ],
)
def test_an_edited_request_is_another_intent(edit: dict[str, object]) -> None:
    edited = dataclasses.replace(ITEM, **edit)  # type: ignore[arg-type]
    assert identify(edited, "batch").request_hash != identify(ITEM, "batch").request_hash
    assert identify(edited, "batch").key != identify(ITEM, "batch").key


def test_meta_and_line_are_not_part_of_the_intent() -> None:
    moved = dataclasses.replace(ITEM, meta={"chapter": 3}, line=99)
    assert identify(moved, "batch") == identify(ITEM, "batch")


def test_the_prefix_names_the_run() -> None:
    assert identify(ITEM, "run-2").key != identify(ITEM, "batch").key
    assert identify(ITEM, "run-2").request_hash == identify(ITEM, "batch").request_hash
    assert prefix_of(identify(ITEM, "run:2").key, ITEM.id) == "run:2"


@pytest.mark.parametrize("item_id", ["q-1", "x" * 100, "x" * 101, "naïve", "a b", 'q"1', "a,b"])
def test_every_key_is_one_the_proxy_accepts(item_id: str) -> None:
    key = identify(dataclasses.replace(ITEM, id=item_id), "batch").key
    assert parse_key([key]) == key
    assert prefix_of(key, item_id) == "batch"


def test_unsafe_ids_enter_the_key_as_a_hash() -> None:
    one = identify(dataclasses.replace(ITEM, id="a b"), "batch").key
    other = identify(dataclasses.replace(ITEM, id="a  b"), "batch").key
    assert one.split(":")[1].startswith("~") and one != other


@pytest.mark.parametrize("prefix", ["", "a,b", 'a"b', "a\\b", "a b", "é", "x" * 65])
def test_bad_prefixes_are_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="key prefix"):
        check_prefix(prefix)


def test_good_prefixes_pass() -> None:
    assert check_prefix("exam/2024:run#1") == "exam/2024:run#1"
