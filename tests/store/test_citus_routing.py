"""Every hot-path statement can be routed to one shard when the tables are distributed by owner
(SPEC §11: `owner` leads every key, so that Citus can shard both tables by it).

This is the static check, which runs everywhere; tests/store/test_citus.py asks a real Citus
cluster with EXPLAIN that each of these statements is planned as a router query on one shard.

A statement is routable when every reference to `jobs` or `attempts` in it is pinned to one
owner: an INSERT lists `owner` among its columns (and in its conflict target) and takes its
value from the parameter, and an UPDATE, DELETE or SELECT names `owner = <the parameter>` in its
WHERE clause. Data-modifying CTEs count as statements of their own; an owner taken from another
CTE's rows (`a.owner = job.owner`) is not enough, because the planner cannot see through it to
the shard. The check reads the named sections with `load_queries`, as the stores do.
"""

from __future__ import annotations

import re

import pytest

from idemproxy.store.queries import load_migrations, load_queries

POSTGRES_HOT_PATH = (
    "claim",
    "get_job",
    "watch_job",
    "complete",
    "complete_sole",
    "settle",
    "finish_attempt",
    "start_next_attempt",
    "fail_over",
    "add_attempt",
    "renew_lease",
    "take_over",
    "forget",
)
SQLITE_HOT_PATH = (
    "insert_job",
    "insert_attempt",
    "get_job",
    "complete_job",
    "finish_attempt",
    "discard_attempt",
    "settle_job",
    "reopen_job",
    "advance_job",
    "count_attempt",
    "renew_job_lease",
    "renew_attempt_leases",
    "take_over_job",
    "lose_attempts",
    "forget",
)
# Statements that span owners by design: operators, housekeeping and health. Every other
# statement must be routable, so a new query has to be listed here to be exempt.
CROSS_OWNER = {
    "postgres": {
        "get_job_by_id",
        "stale_unknown",
        "expired_leases",
        "sweep_expired",
        "sweep_expired_distributed",
        "list_jobs",
        "count_unknown",
        # SPEC §3.6: the reconciler's pages of the unknown jobs due a question, of every owner.
        "due_unknown",
        "ping",
        # `idemproxy store reseal` walks every owner's responses (SPEC §11).
        "responses_to_reseal",
        "late_responses_to_reseal",
    },
    "sqlite": {
        "get_job_by_id",
        "stale_unknown",
        "expired_leases",
        "sweep_expired",
        "list_jobs",
        "count_unknown",
        "due_unknown",
        # At open: a write that changes nothing, of no owner's rows.
        "read_only",
        "responses_to_reseal",
        "late_responses_to_reseal",
    },
}
HOT_PATH = {"postgres": POSTGRES_HOT_PATH, "sqlite": SQLITE_HOT_PATH}

_TABLE = r"(?:idemproxy\.)?(?:jobs|attempts)\b"
_REFERENCE = re.compile(rf"\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM|FROM|JOIN)\s+({_TABLE})", re.I)
# The owner parameter: `$1` in PostgreSQL, `:owner` in SQLite.
_PARAMETER = r"(?:\$\d+|:owner)"
_OWNER_FILTER = re.compile(rf"\bWHERE\b.*?(?:\b\w+\.)?\bowner\s*=\s*{_PARAMETER}\b", re.I | re.S)
_COMMENT = re.compile(r"--[^\n]*")


def strip_comments(sql: str) -> str:
    return _COMMENT.sub("", sql)


def scope_of(sql: str, start: int) -> str:
    """From `start` to the end of the enclosing statement: the parenthesis that closes the CTE
    or subquery it sits in, a UNION, or the end of the text."""
    depth = 0
    for index in range(start, len(sql)):
        char = sql[index]
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                return sql[start:index]
        elif depth == 0 and re.match(r"UNION\b", sql[index:], re.I):
            return sql[start:index]
    return sql[start:]


def unpinned_references(sql: str) -> list[str]:
    """Each reference to jobs/attempts that does not name the owner, described for a message."""
    sql = strip_comments(sql)
    problems = []
    for match in _REFERENCE.finditer(sql):
        verb = " ".join(match.group(1).upper().split())
        scope = scope_of(sql, match.end())
        where = f"{verb} {match.group(2)}"
        if verb == "INSERT INTO":
            columns = re.match(r"\s*\(([^)]*)\)", scope)
            if columns is None or "owner" not in _names(columns.group(1)):
                problems.append(f"{where}: `owner` is not an inserted column")
            else:
                value = _inserted_owner(columns.group(1), scope[columns.end() :])
                if value is not None and not re.fullmatch(_PARAMETER, value):
                    problems.append(f"{where}: the owner inserted is {value!r}, not the parameter")
            conflict = re.search(r"ON\s+CONFLICT\s*\(([^)]*)\)", scope, re.I)
            if conflict is not None and "owner" not in _names(conflict.group(1)):
                problems.append(f"{where}: the conflict target does not name `owner`")
        elif not _OWNER_FILTER.search(scope):
            problems.append(f"{where}: no `owner = …` in its WHERE clause")
    return problems


def _names(columns: str) -> list[str]:
    return [column.strip().lower() for column in columns.split(",")]


def _inserted_owner(columns: str, rest: str) -> str | None:
    """The expression inserted as `owner` by `INSERT … SELECT`; None for `VALUES`."""
    select = re.match(r"\s*SELECT\s+(.*?)\s+FROM\b", rest, re.I | re.S)
    if select is None:
        return None
    values = [value.strip() for value in select.group(1).split(",")]
    return values[_names(columns).index("owner")]


@pytest.mark.parametrize(
    ("dialect", "name"),
    [("postgres", name) for name in POSTGRES_HOT_PATH]
    + [("sqlite", name) for name in SQLITE_HOT_PATH],
)
def test_hot_path_statements_name_the_owner(dialect: str, name: str) -> None:
    queries = load_queries(dialect)
    assert name in queries, f"{dialect} has no query named {name!r}"
    sql = queries[name]
    assert _REFERENCE.search(strip_comments(sql)), f"{name} touches neither table"
    assert unpinned_references(sql) == []


@pytest.mark.parametrize("dialect", ["postgres", "sqlite"])
def test_every_other_statement_names_the_owner_or_is_known_to_span_owners(dialect: str) -> None:
    queries = load_queries(dialect)
    assert CROSS_OWNER[dialect] <= queries.keys()
    unpinned = {
        name: problems
        for name, sql in queries.items()
        if name not in CROSS_OWNER[dialect] and (problems := unpinned_references(sql))
    }
    assert unpinned == {}


def test_the_postgres_schema_leads_every_key_with_the_owner() -> None:
    # Citus requires the distribution column in every primary key, unique constraint and
    # foreign key between distributed tables.
    [(_version, schema)] = [m for m in load_migrations("postgres") if m[0].startswith("0001")]
    schema = strip_comments(schema)
    keys = re.findall(r"\b(PRIMARY KEY|UNIQUE|FOREIGN KEY)\s*\(([^)]*)\)", schema, re.I)
    references = re.findall(r"\bREFERENCES\s+\S+\s*\(([^)]*)\)", schema, re.I)
    assert len(keys) >= 4  # jobs: primary key, unique (owner, id); attempts: primary, foreign
    for kind, columns in keys:
        assert columns.split(",")[0].strip() == "owner", f"{kind} ({columns})"
    for columns in references:
        assert columns.split(",")[0].strip() == "owner", f"REFERENCES ({columns})"
    assert not re.search(r"\bUNIQUE\b(?!\s*\()", schema), "a column-level UNIQUE lacks the owner"


# --- the checker itself -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sql", "problem"),
    [
        ("UPDATE idemproxy.jobs SET state = 'x' WHERE id = $1", "no `owner"),
        ("DELETE FROM jobs WHERE id = :id", "no `owner"),
        ("SELECT * FROM idemproxy.attempts WHERE job_id = $1", "no `owner"),
        ("INSERT INTO attempts (job_id, number) VALUES ($1, 1)", "not an inserted column"),
        (
            "INSERT INTO jobs (owner, key) VALUES ($1, $2) ON CONFLICT (key) DO NOTHING",
            "conflict target",
        ),
        (
            "WITH j AS (UPDATE jobs SET v = 1 WHERE owner = $1 RETURNING id) "
            "UPDATE attempts SET v = 2 WHERE job_id IN (SELECT id FROM j)",
            "UPDATE attempts: no `owner",
        ),
        (
            "SELECT * FROM jobs WHERE owner = $1 UNION ALL SELECT * FROM jobs WHERE id = $2",
            "FROM jobs: no `owner",
        ),
        (
            "WITH job AS (UPDATE jobs SET v = 1 WHERE owner = $1 AND id = $2 RETURNING owner, id) "
            "UPDATE attempts a SET v = 2 FROM job WHERE a.owner = job.owner AND a.job_id = job.id",
            "UPDATE attempts: no `owner",
        ),
        (
            "WITH job AS (UPDATE jobs SET v = 1 WHERE owner = $1 RETURNING *) "
            "INSERT INTO attempts (job_id, owner, number) SELECT id, owner, 2 FROM job",
            "not the parameter",
        ),
    ],
)
def test_the_checker_catches_unrouted_statements(sql: str, problem: str) -> None:
    problems = unpinned_references(sql)
    assert len(problems) == 1 and problem in problems[0], problems


def test_the_checker_accepts_routed_statements() -> None:
    sql = """
        WITH job AS (
            UPDATE idemproxy.jobs SET v = 1 -- a comment naming FROM jobs
            WHERE owner = $1 AND id = $2 RETURNING owner, id
        )
        UPDATE idemproxy.attempts a SET v = 2 FROM job
        WHERE a.owner = $1 AND a.job_id = job.id
    """
    assert unpinned_references(sql) == []
    insert = """
        WITH job AS (UPDATE jobs SET n = n + 1 WHERE owner = :owner RETURNING id, n)
        INSERT INTO attempts (owner, job_id, number) SELECT :owner, id, n FROM job
    """
    assert unpinned_references(insert) == []
