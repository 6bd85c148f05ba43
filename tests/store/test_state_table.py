"""Both stores' SQL follows the core's state table (core/states.py).

The statements write their states as literals (a partial index only serves a literal), so the
table is not passed in: this test reads every named statement of both dialects, as the stores
load them, and derives from its text what it does to the jobs and attempts it changes: the job
states its WHERE clause accepts, the state it sets, whether it bumps the version, what it does
to the lease, and which attempt states it moves to which. Each operation's statements must do
exactly what `TRANSITIONS` says, and every state the SQL names must be one the core knows.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import pytest

from idemproxy.core.states import (
    EXPIRABLE,
    LATE_RESPONSE_KEPT,
    LEASED,
    RESOLVABLE,
    RUNNING,
    TRANSITIONS,
    AttemptChange,
    Lease,
    Operation,
    Transition,
)
from idemproxy.core.types import AttemptState, JobState
from idemproxy.store.queries import load_migrations, load_queries

# The statements each store runs for each operation (the SQLite store runs several in one
# transaction where PostgreSQL has one statement with data-modifying CTEs).
STATEMENTS: dict[str, dict[Operation, tuple[str, ...]]] = {
    "postgres": {
        Operation.CLAIM: ("claim",),
        Operation.COMPLETE: ("complete",),
        Operation.SETTLE_RELEASED: ("settle",),
        Operation.SETTLE_UNKNOWN: ("settle",),
        Operation.FINISH_ATTEMPT_RELEASED: ("finish_attempt",),
        Operation.FINISH_ATTEMPT_UNKNOWN: ("finish_attempt",),
        Operation.START_NEXT_ATTEMPT: ("start_next_attempt",),
        Operation.FAIL_OVER: ("fail_over",),
        Operation.ADD_ATTEMPT: ("add_attempt",),
        Operation.RENEW_LEASE: ("renew_lease",),
        Operation.TAKE_OVER: ("take_over",),
        Operation.RESEND: ("resend_job", "add_attempt_row"),
        Operation.RESOLVE_COMPLETED: ("resolve_completed",),
        Operation.RESOLVE_RELEASED: ("resolve_released",),
        Operation.FORGET: ("forget",),
        Operation.SWEEP: ("sweep_expired",),
        Operation.DELETE: ("delete_job",),
    },
    "sqlite": {
        Operation.CLAIM: ("insert_job", "insert_attempt"),
        Operation.COMPLETE: ("complete_job", "succeed_attempt", "discard_attempt"),
        Operation.SETTLE_RELEASED: ("settle_job", "finish_attempt"),
        Operation.SETTLE_UNKNOWN: ("settle_job", "finish_attempt"),
        Operation.FINISH_ATTEMPT_RELEASED: ("finish_attempt",),
        Operation.FINISH_ATTEMPT_UNKNOWN: ("finish_attempt",),
        Operation.START_NEXT_ATTEMPT: ("reopen_job", "insert_attempt"),
        Operation.FAIL_OVER: ("advance_job", "finish_attempt", "insert_attempt"),
        Operation.ADD_ATTEMPT: ("count_attempt", "insert_attempt"),
        Operation.RENEW_LEASE: ("renew_job_lease", "renew_attempt_leases"),
        Operation.TAKE_OVER: ("take_over_job", "lose_attempts"),
        Operation.RESEND: ("resend_job", "insert_attempt"),
        Operation.RESOLVE_COMPLETED: ("resolve_completed",),
        Operation.RESOLVE_RELEASED: ("resolve_released",),
        Operation.FORGET: ("forget",),
        Operation.SWEEP: ("sweep_expired",),
        Operation.DELETE: ("delete_job",),
    },
}
# A state written from the store's parameter: the store passes `settle_states` / `attempt_end`
# (tests/unit/test_states.py checks those against the table).
PARAMETER = "<parameter>"
# The state an INSERT leaves to the column's default (test_the_schema_... checks the default).
DEFAULT = "<default>"

_STATE_LIST = r"'(\w+)'(?:\s*,\s*'(\w+)')*"
_LITERAL = re.compile(r"'(\w+)'")
_PARAM = r"(\$\d+|:\w+)"
# The end of an UPDATE's WHERE clause: RETURNING, the end of its CTE, or of the statement.
_WHERE_END = r"(?=\bRETURNING\b|\)\s*,\s*\w+\s+AS\s*\(|\)\s*(?:SELECT|INSERT)\b|\s*;|\Z)"
_JOB_UPDATE = re.compile(
    r"UPDATE\s+(?:idemproxy\.)?jobs\s+SET\s+(?P<set>.*?)\s+WHERE\s+(?P<where>.*?)" + _WHERE_END,
    re.DOTALL,
)
_ATTEMPT_UPDATE = re.compile(
    r"UPDATE\s+(?:idemproxy\.)?attempts(?:\s+a)?\s+SET\s+(?P<set>.*?)"
    r"(?:\s+FROM\s+\w+)?\s+WHERE\s+(?P<where>.*?)" + _WHERE_END,
    re.DOTALL,
)
_JOB_INSERT = re.compile(r"INSERT\s+INTO\s+(?:idemproxy\.)?jobs\b")
_ATTEMPT_INSERT = re.compile(r"INSERT\s+INTO\s+(?:idemproxy\.)?attempts\b")
_JOB_DELETE = re.compile(r"DELETE\s+FROM\s+(?:idemproxy\.)?jobs\s+WHERE\s+(?P<where>.*)", re.DOTALL)


@dataclass(frozen=True)
class JobEffect:
    """What statements do to a job row, as their text says."""

    source: frozenset[str]
    target: str | None
    bumps_version: bool
    lease: Lease
    deletes: bool = False
    creates: bool = False


def _states(where: str, column: str = r"(?:a\.)?state") -> frozenset[str] | None:
    """The states a WHERE clause accepts (`state = 'x'` or `state IN (...)`); None: any."""
    equal = re.search(rf"\b{column}\s*=\s*'(\w+)'", where)
    if equal:
        return frozenset({equal.group(1)})
    among = re.search(rf"\b{column}\s+IN\s*\(({_STATE_LIST})\)", where)
    if among:
        return frozenset(_LITERAL.findall(among.group(1)))
    return None


def _set_states(assignments: str) -> frozenset[str] | None:
    """The state(s) a SET clause writes: a literal, the branches of a CASE, or a parameter."""
    case = re.search(r"\bstate\s*=\s*CASE\b(?P<case>.*?)\bEND\b", assignments, re.DOTALL)
    if case:
        return frozenset(re.findall(r"(?:THEN|ELSE)\s+'(\w+)'", case.group("case")))
    literal = re.search(r"\bstate\s*=\s*'(\w+)'", assignments)
    if literal:
        return frozenset({literal.group(1)})
    if re.search(rf"\bstate\s*=\s*{_PARAM}", assignments):
        return frozenset({PARAMETER})
    return None


def _lease(assignments: str) -> Lease:
    if re.search(r"\blease_expires_at\s*=\s*NULL\b", assignments):
        return Lease.CLEARED
    if re.search(r"\blease_expires_at\s*=", assignments):
        return Lease.RENEWED
    return Lease.KEPT


def job_effect(sql: str) -> JobEffect | None:
    """The effect on the job of all these statements (one of them changes the job)."""
    effects: list[JobEffect] = []
    any_state = frozenset(state.value for state in JobState)
    if _JOB_INSERT.search(sql):
        effects.append(JobEffect(frozenset(), DEFAULT, False, Lease.RENEWED, creates=True))
    for update in _JOB_UPDATE.finditer(sql):
        targets = _set_states(update["set"])
        assert targets is None or len(targets) == 1, targets
        effects.append(
            JobEffect(
                source=_states(update["where"]) or any_state,
                target=None if targets is None else next(iter(targets)),
                bumps_version=bool(re.search(r"version\s*=\s*version\s*\+\s*1", update["set"])),
                lease=_lease(update["set"]),
            )
        )
    for delete in _JOB_DELETE.finditer(sql):
        where = delete["where"]
        accepted = _states(where) or any_state
        effects.append(JobEffect(accepted, None, False, Lease.KEPT, deletes=True))
    assert len(effects) <= 1, f"more than one change of the job: {effects}"
    return effects[0] if effects else None


def attempt_effects(sql: str) -> frozenset[tuple[frozenset[str], str | None]]:
    """(accepted attempt states, new state) of every attempt update; None: the state stays.
    An update that only clears the leases of a job's attempts is `attempt_leases_cleared`'s."""
    any_state = frozenset(state.value for state in AttemptState)
    found: set[tuple[frozenset[str], str | None]] = set()
    for update in _ATTEMPT_UPDATE.finditer(sql):
        if _clears_leases_only(update["set"]):
            continue
        source = _states(update["where"]) or any_state
        targets = _set_states(update["set"])
        if targets is None:
            found.add((source, None))
        else:
            found.update((source, target) for target in targets)
    return frozenset(found)


def _clears_leases_only(assignments: str) -> bool:
    return re.fullmatch(r"\s*lease_expires_at\s*=\s*NULL\s*", assignments) is not None


def attempt_leases_cleared(sql: str) -> bool:
    """Whether these statements clear the lease of attempts whose state they leave as it is."""
    return any(_clears_leases_only(u["set"]) for u in _ATTEMPT_UPDATE.finditer(sql))


def _expected_job(transition: Transition) -> JobEffect:
    return JobEffect(
        source=frozenset(state.value for state in transition.source),
        target=None if transition.target is None else transition.target.value,
        bumps_version=transition.bumps_version,
        lease=transition.lease,
        deletes=transition.deletes,
        creates=not transition.source and not transition.deletes,
    )


def _expected_attempts(
    transition: Transition,
) -> frozenset[tuple[frozenset[str], str | None]]:
    return frozenset(
        (frozenset(state.value for state in change.source), change.target.value)
        for change in transition.attempts
    )


def _values(states: Iterable[JobState]) -> frozenset[str]:
    return frozenset(state.value for state in states)


def _queries(dialect: str) -> dict[str, str]:
    """The named statements as the store loads them, without their comments."""
    return {name: re.sub(r"--[^\n]*", "", sql) for name, sql in load_queries(dialect).items()}


def _cases() -> Iterator[tuple[str, Operation]]:
    for dialect, operations in STATEMENTS.items():
        yield from ((dialect, operation) for operation in operations)


def test_every_operation_has_its_statements() -> None:
    for operations in STATEMENTS.values():
        assert set(operations) == set(Operation)


@pytest.mark.parametrize(("dialect", "operation"), list(_cases()))
def test_the_statements_follow_the_table(dialect: str, operation: Operation) -> None:
    queries = _queries(dialect)
    sql = "\n;\n".join(queries[name] for name in STATEMENTS[dialect][operation])
    transition = TRANSITIONS[operation]
    expected = _expected_job(transition)
    job = job_effect(sql)
    if _job_untouched(transition):
        assert job is None, f"{dialect} {operation}: the job is left alone, not {job}"
    else:
        assert job is not None, f"{dialect} {operation}: no statement changes the job"
        if job.target in (PARAMETER, DEFAULT):
            job = JobEffect(
                job.source, expected.target, job.bumps_version, job.lease, creates=job.creates
            )
        assert job == expected, f"{dialect} {operation}"

    attempts = attempt_effects(sql)
    changed: set[tuple[frozenset[str], str | None]] = {
        (source, target) for source, target in attempts if target is not None
    }
    wanted = set(_expected_attempts(transition))
    if any(target == PARAMETER for _, target in changed):
        # The state is the store's argument (`settle_states`, `attempt_end`): the table's.
        changed = {(source, t) for source, _ in changed for _, t in wanted}
    assert changed == wanted, f"{dialect} {operation}: attempt states"
    renewed = {source for source, target in attempts if target is None}
    running = {frozenset(state.value for state in RUNNING)}
    renews_attempts = operation is Operation.RENEW_LEASE and _RENEWS_ATTEMPTS[dialect]
    assert renewed == (running if renews_attempts else set()), operation
    inserts_attempt = bool(_ATTEMPT_INSERT.search(sql))
    assert inserts_attempt == transition.new_attempt, f"{dialect} {operation}: a new attempt"
    ends_job = _ENDS_ATTEMPT_LEASES[dialect] and transition.lease is Lease.CLEARED
    assert attempt_leases_cleared(sql) == ends_job, f"{dialect} {operation}: attempts' leases"


# Whether a renewal renews the running attempts' leases too. On PostgreSQL the job alone holds
# the lease as renewed (an update in place) and each attempt the lease it started with, by which
# the lease scan finds it (migration 0007, queries.sql `expired_leases`).
_RENEWS_ATTEMPTS = {"postgres": False, "sqlite": True}
# Whether the statements that end a job in flight (the job's lease cleared) also clear the leases
# its attempts keep: on PostgreSQL an attempt keeps the lease it started with until its job
# ends, finished or not, so that the lease scan finds a job whose attempts all ended unsettled
# (migration 0009). SQLite's scan reads the jobs themselves.
_ENDS_ATTEMPT_LEASES = {"postgres": True, "sqlite": False}


def _job_untouched(transition: Transition) -> bool:
    return (
        transition.target is None
        and not transition.deletes
        and not transition.bumps_version
        and transition.lease is Lease.KEPT
    )


@pytest.mark.parametrize("dialect", ["postgres", "sqlite"])
def test_the_reads_use_the_tables_sets(dialect: str) -> None:
    queries = _queries(dialect)
    text = "\n".join(queries.values())
    # lease_expired is computed for the leased states only; an operator's unforced delete
    # spares those states under a live lease.
    lease_states = frozenset(re.findall(r"state\s*=\s*'(\w+)'\s+AND\s+lease_expires_at\s*<=", text))
    leased = _values(LEASED)
    assert lease_states == leased
    assert frozenset(re.findall(r"state\s*<>\s*'(\w+)'", queries["delete_job"])) == leased
    assert _states(queries["expired_leases"]) == leased
    resolvable = _values(RESOLVABLE)
    assert _states(queries["stale_unknown"]) == resolvable
    assert _states(queries["count_unknown"]) == resolvable
    expirable = _values(EXPIRABLE)
    assert _states(queries["forget"]) == expirable
    assert _states(queries["sweep_expired"]) == expirable
    keep = queries["complete"] if dialect == "postgres" else queries["may_keep_late"]
    kept = re.search(r"FROM (?:idemproxy\.)?jobs\s+WHERE .*?state = '(\w+)'", keep)
    assert kept is not None
    assert frozenset({kept.group(1)}) == _values(LATE_RESPONSE_KEPT)


@pytest.mark.parametrize("dialect", ["postgres", "sqlite"])
def test_every_state_the_sql_names_is_the_cores(dialect: str) -> None:
    known = {state.value for state in JobState} | {state.value for state in AttemptState}
    for name, sql in _queries(dialect).items():
        clauses = re.finditer(
            r"\bstate\s*(?:=|<>|IN)\s*(\(?'[^)]*?'\)?|CASE.*?END)", sql, re.DOTALL
        )
        for clause in clauses:
            named = set(_LITERAL.findall(clause.group(1)))
            assert named <= known, f"{dialect} {name}: {named - known}"


@pytest.mark.parametrize("dialect", ["postgres", "sqlite"])
def test_the_schema_allows_exactly_the_cores_states(dialect: str) -> None:
    _, sql = load_migrations(dialect)[0]
    checks = [
        set(_LITERAL.findall(group)) for group in re.findall(r"CHECK \(state IN \(([^)]*)\)\)", sql)
    ]
    assert checks == [{s.value for s in JobState}, {s.value for s in AttemptState}]
    defaults = re.findall(r"\bstate\s+\w+\s+NOT NULL DEFAULT '(\w+)'", sql, re.IGNORECASE)
    claim = TRANSITIONS[Operation.CLAIM]
    assert claim.target is not None
    assert defaults == [claim.target.value, AttemptState.STARTED.value]


def test_a_wrong_table_is_caught() -> None:
    """The reading is not vacuous: a table that says `take_over` leaves the job released fails."""
    sql = _queries("postgres")["take_over"]
    job = job_effect(sql)
    assert job is not None
    wrong = TRANSITIONS[Operation.TAKE_OVER]
    assert job != _expected_job(
        Transition(wrong.source, JobState.RELEASED, wrong.bumps_version, wrong.lease)
    )
    assert job == _expected_job(wrong)
    assert attempt_effects(sql) == _expected_attempts(wrong)
    assert AttemptChange(frozenset({AttemptState.STARTED}), AttemptState.UNKNOWN) in wrong.attempts
