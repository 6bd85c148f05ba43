"""Pure: given the input items and what the results file already holds, what this run sends.

no result yet                           → send
result for another request hash         → changed: reported and left out, or sent under its
                                          new key with `rerun_changed` (a new intent, §1)
result under another key, same request  → the key prefix changed: refuse (a resumed item
                                          would be paid for twice)
done                                    → skip
failed, retries ran out (retryable)     → send again, same key
failed for good                         → skip, unless `retry_failed`
unknown                                 → skip, unless `retry_unknown` (after an operator
                                          resolved the job, SPEC §3.3)
omitted                                 → skip, unless `retry_omitted`: it executed once and
                                          the proxy replays it without a body (SPEC §7), so
                                          sending it again brings nothing back and, after an
                                          operator deleted the job, would pay again
any result under another key header     → refuse: the in-flight items would go out without
                                          the key the proxy knows them by, and execute again
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from idemproxy.batch.checkpoint import RunKeys
from idemproxy.batch.errors import KeyHeaderChanged, KeyPrefixChanged
from idemproxy.batch.input import Item
from idemproxy.batch.keys import Identity, identify, prefix_of
from idemproxy.batch.records import Outcome, ResultRecord


@dataclass(frozen=True)
class PlanRules:
    key_prefix: str
    retry_failed: bool = False
    retry_unknown: bool = False
    rerun_changed: bool = False
    retry_omitted: bool = False
    key_header: str | None = None  # None: not checked


@dataclass
class Plan:
    send: list[tuple[Item, Identity]] = field(default_factory=list)
    skipped_done: int = 0
    kept_failed: int = 0  # failed for good earlier, not retried this run
    kept_unknown: int = 0
    kept_omitted: int = 0  # executed, answered without the body the proxy did not store
    changed: list[Item] = field(default_factory=list)  # edited since their result was written

    @property
    def skipped(self) -> int:
        """Items not sent because the results file already answers them."""
        return self.skipped_done + self.kept_failed + self.kept_unknown + self.kept_omitted


def make_plan(
    items: Sequence[Item],
    records: Mapping[str, ResultRecord],
    rules: PlanRules,
    keys: RunKeys | None = None,
) -> Plan:
    """`keys`: the keys the last run of the results file sent under (its keys line), if any."""
    _check_keys(keys, rules)
    _check_key_header(records.values(), rules.key_header)
    # Every result, those of items not in this input too: a run that wrote them under another
    # prefix may have had this input's items in flight under it.
    mismatched = [
        prefix
        for record in records.values()
        if (prefix := prefix_of(record.key, record.id)) != rules.key_prefix
    ]
    if mismatched:
        raise KeyPrefixChanged(
            f"{len(mismatched)} result(s) were written with --key-prefix {mismatched[0]!r}, "
            f"not {rules.key_prefix!r}; resume with the same prefix, or a resumed item could "
            "execute twice (write to another results file for a fresh run)"
        )
    plan = Plan()
    for item in items:
        _place(plan, item, identify(item, rules.key_prefix), records.get(item.id), rules)
    return plan


def _check_keys(keys: RunKeys | None, rules: PlanRules) -> None:
    """The last run may have items in flight under its keys with no line yet (it was stopped
    before their answers): a resume under other keys would send them again (SPEC §14)."""
    if keys is None:
        return
    if keys.prefix != rules.key_prefix:
        raise KeyPrefixChanged(
            f"the last run on these results sent its items with --key-prefix {keys.prefix!r},"
            f" not {rules.key_prefix!r}; resume with the same prefix, or an item it had in"
            " flight could execute twice (write to another results file for a fresh run)"
        )
    if rules.key_header is not None and keys.header.lower() != rules.key_header.lower():
        raise KeyHeaderChanged(
            f"the last run on these results sent its items with --key-header {keys.header!r},"
            f" not {rules.key_header!r}; resume with the same header, or an item it had in"
            " flight could execute twice (write to another results file for a fresh run)"
        )


def _check_key_header(records: Iterable[ResultRecord], key_header: str | None) -> None:
    """Every result, not only those of this input: the item in flight has none (SPEC §14)."""
    if key_header is None:
        return
    for record in records:
        if record.key_header is not None and record.key_header.lower() != key_header.lower():
            raise KeyHeaderChanged(
                f"the results were written with --key-header {record.key_header!r}, not "
                f"{key_header!r}; resume with the same header, or an item in flight could "
                "execute twice (write to another results file for a fresh run)"
            )


def _place(
    plan: Plan, item: Item, identity: Identity, record: ResultRecord | None, rules: PlanRules
) -> None:
    if record is None:
        plan.send.append((item, identity))
    elif record.request_hash != identity.request_hash:
        if rules.rerun_changed:
            plan.send.append((item, identity))
        else:
            plan.changed.append(item)
    elif record.outcome is Outcome.DONE:
        plan.skipped_done += 1
    elif _again(record, rules):
        plan.send.append((item, identity))
    elif record.outcome is Outcome.FAILED:
        plan.kept_failed += 1
    elif record.outcome is Outcome.OMITTED:
        plan.kept_omitted += 1
    else:
        plan.kept_unknown += 1


def _again(record: ResultRecord, rules: PlanRules) -> bool:
    """Whether an item with a result other than `done` is sent again (under the same key)."""
    if record.outcome is Outcome.FAILED:
        return record.retryable or rules.retry_failed
    if record.outcome is Outcome.OMITTED:
        return rules.retry_omitted
    return rules.retry_unknown
