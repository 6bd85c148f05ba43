"""What a rerun sends, given what the results file already holds (SPEC §14)."""

from __future__ import annotations

import dataclasses

import pytest

from idemproxy.batch.errors import KeyPrefixChanged
from idemproxy.batch.input import Item
from idemproxy.batch.plan import PlanRules, make_plan
from idemproxy.batch.records import Outcome

from .factory import record

ITEMS = [Item(name, "POST", "/x", body={"id": name}) for name in "abcdef"]
RECORDS = {
    "a": record(ITEMS[0]),
    "b": record(ITEMS[1], Outcome.FAILED),
    "c": record(ITEMS[2], Outcome.FAILED, retryable=True, status=503),
    "d": record(ITEMS[3], Outcome.UNKNOWN, status=409, error_code="outcome-unknown"),
    "e": record(dataclasses.replace(ITEMS[4], body={"id": "e", "edited": False})),
}


def _sent(rules: PlanRules) -> list[str]:
    return [item.id for item, _ in make_plan(ITEMS, RECORDS, rules).send]


def test_by_default_only_new_and_retryable_items_are_sent() -> None:
    plan = make_plan(ITEMS, RECORDS, PlanRules("batch"))
    assert [item.id for item, _ in plan.send] == ["c", "f"]
    assert (plan.skipped_done, plan.kept_failed, plan.kept_unknown) == (1, 1, 1)
    assert plan.skipped == 3
    assert [item.id for item in plan.changed] == ["e"]


@pytest.mark.parametrize(
    ("rules", "extra"),
    [
        (PlanRules("batch", retry_failed=True), "b"),
        (PlanRules("batch", retry_unknown=True), "d"),
        (PlanRules("batch", rerun_changed=True), "e"),
    ],
)
def test_flags_send_more(rules: PlanRules, extra: str) -> None:
    assert _sent(rules) == sorted(["c", "f", extra])


def test_a_changed_item_is_sent_under_its_new_key() -> None:
    plan = make_plan(ITEMS, RECORDS, PlanRules("batch", rerun_changed=True))
    identity = dict((item.id, identity) for item, identity in plan.send)["e"]
    assert identity.key != RECORDS["e"].key


def test_another_prefix_for_the_same_requests_is_refused() -> None:
    with pytest.raises(KeyPrefixChanged, match="--key-prefix 'batch', not 'other'"):
        make_plan(ITEMS, RECORDS, PlanRules("other"))


def test_an_empty_results_file_sends_everything() -> None:
    assert len(make_plan(ITEMS, {}, PlanRules("batch")).send) == len(ITEMS)
