"""The soak's checker: reads a results directory, checks every invariant, writes the report.

    .venv/bin/python bench/soak/check.py RESULTS_DIR

Reads run.json, history.jsonl (one line per request), ledger.jsonl (one line per request that
reached the backend), events.jsonl (faults), samples.jsonl (fds, RSS, pg connections, load),
store-end.json (after the quiet period) and store-final.json (after the stale jobs were retried),
and writes report.json and report.md next to them. Standard library only.

Owners are compared by marker: the first 16 hex digits of SHA-256 of the Authorization header
(the backend's echo), or "anonymous"; the store keeps the whole hash (SPEC §5).
"""

from __future__ import annotations

import itertools
import json
import re
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MAX_SHOWN = 20  # violations listed per check
PROBLEM_STATUS = {
    "key-missing": 400,
    "key-invalid": 400,
    "owner-missing": 401,
    "payload-mismatch": 409,
    "request-in-flight": 409,
    "outcome-unknown": 409,
    "body-too-large": 413,
    "upstream-unavailable": 502,
    "store-unavailable": 503,
    "too-many-waiters": 503,
    "upstream-timeout": 504,
}
BACKEND_STATUSES = {201, 502, 503, 504}


def marker_of_store_owner(owner: str) -> str:
    return owner if owner == "anonymous" else owner[:16]


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Check:
    def __init__(self, name: str, claim: str) -> None:
        self.name = name
        self.claim = claim
        self.checked = 0
        self.violations: list[str] = []
        self.count = 0
        self.notes: list[str] = []
        self.applicable = True

    def ok(self, n: int = 1) -> None:
        self.checked += n

    def fail(self, detail: str) -> None:
        self.checked += 1
        self.count += 1
        if len(self.violations) < MAX_SHOWN:
            self.violations.append(detail)

    def result(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "claim": self.claim,
            "passed": self.count == 0,
            "applicable": self.applicable,
            "checked": self.checked,
            "violations": self.count,
            "examples": self.violations,
            "notes": self.notes,
        }


class Soak:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.run: dict[str, Any] = json.loads((directory / "run.json").read_text())
        self.history = _lines(directory / "history.jsonl")
        self.ledger = _lines(directory / "ledger.jsonl")
        self.events = _lines(directory / "events.jsonl")
        self.samples = _lines(directory / "samples.jsonl")
        self.store_end = json.loads((directory / "store-end.json").read_text())
        self.store_final = json.loads((directory / "store-final.json").read_text())
        self.answered = [r for r in self.history if r.get("status") is not None]
        self.by_job: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.by_intent: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for arrival in sorted(self.ledger, key=lambda a: a["seq"]):
            self.by_job[arrival["job"]].append(arrival)
            self.by_intent[(arrival["owner"], arrival["key"])].append(arrival)
        self.jobs_final = {
            (marker_of_store_owner(j["owner"]), j["key"]): j for j in self.store_final["jobs"]
        }
        self.jobs_by_id = {j["id"]: j for j in self.store_final["jobs"]}
        self.answers_by_intent: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for record in self.answered:
            self.answers_by_intent[(record["owner"], record["key"])].append(record)

    def executed(self, job: str) -> list[dict[str, Any]]:
        return [a for a in self.by_job.get(job, []) if a["executed"]]

    # -- invariants ------------------------------------------------------------------------

    def single_execution(self) -> Check:
        check = Check(
            "single_execution",
            "the backend executed each (owner, key, job) at most once, and each (owner, key) "
            "at most once (no job expires within a run: ttl 24 h)",
        )
        for (owner, key), arrivals in self.by_intent.items():
            done = [a for a in arrivals if a["executed"]]
            if len(done) > 1:
                check.fail(
                    f"({owner}, {key}) executed {len(done)} times: "
                    f"{[(a['seq'], a['job'], a['attempt']) for a in done]}"
                )
        for job, arrivals in self.by_job.items():
            done = [a for a in arrivals if a["executed"]]
            if len(done) > 1:
                check.fail(
                    f"job {job} ({arrivals[0]['owner']}, {arrivals[0]['key']}) executed "
                    f"{len(done)} times: seq {[a['seq'] for a in done]}"
                )
            else:
                check.ok()
        return check

    def one_job_per_key(self) -> Check:
        check = Check(
            "one_job_per_key",
            "every request the backend got carried the key and job id; one job id per "
            "(owner, key) for the whole run, the one the store holds",
        )
        for (owner, key), arrivals in self.by_intent.items():
            jobs = {a["job"] for a in arrivals}
            stored = self.jobs_final.get((owner, key))
            if key is None or None in jobs:
                check.fail(f"arrival without key or job: seq {[a['seq'] for a in arrivals]}")
            elif len(jobs) > 1:
                check.fail(f"({owner}, {key}) ran under {len(jobs)} jobs: {sorted(jobs)}")
            elif stored is None or stored["id"] not in jobs:
                check.fail(
                    f"({owner}, {key}) ran as job {jobs} but the store holds "
                    f"{stored and stored['id']}"
                )
            else:
                check.ok()
        return check

    def no_forward_after_execution(self) -> Check:
        check = Check(
            "no_forward_after_execution",
            "once an attempt reached the backend and executed, nothing more of that job was "
            "forwarded; attempt numbers only grow (no attempt forwarded twice); every arrival "
            "of a job carries the same payload",
        )
        for job, arrivals in self.by_job.items():
            numbers = [a["attempt"] for a in arrivals]
            first_done = next((i for i, a in enumerate(arrivals) if a["executed"]), None)
            payloads = {a["payload_sha"] for a in arrivals}
            if first_done is not None and first_done < len(arrivals) - 1:
                later = [a["seq"] for a in arrivals[first_done + 1 :]]
                check.fail(
                    f"job {job}: forwarded again after execution seq "
                    f"{arrivals[first_done]['seq']}: seq {later}"
                )
            elif any(b is None or a is None or b <= a for a, b in itertools.pairwise(numbers)):
                check.fail(f"job {job}: attempt numbers {numbers}")
            elif len(payloads) > 1:
                check.fail(f"job {job}: {len(payloads)} different payloads forwarded")
            else:
                check.ok()
        return check

    def identical_bodies(self) -> Check:
        check = Check(
            "identical_bodies",
            "all 2xx answers for one (owner, key) have the same body, the one the backend "
            "produced at the job's single execution; at most one of them is not a replay",
        )
        for (owner, key), answers in self.answers_by_intent.items():
            good = [r for r in answers if 200 <= r["status"] < 300]
            if not good:
                continue
            bodies = {r["body_sha"] for r in good}
            stored = self.jobs_final.get((owner, key))
            done = self.executed(stored["id"]) if stored else []
            fresh = [r for r in good if not r.get("replayed")]
            if len(bodies) > 1:
                check.fail(
                    f"({owner}, {key}): {len(bodies)} different 2xx bodies in requests "
                    f"{[r['id'] for r in good]}"
                )
            elif len(done) != 1 or done[0]["body_sha"] not in bodies:
                check.fail(
                    f"({owner}, {key}): 2xx body {bodies} but executions "
                    f"{[(a['seq'], a['body_sha']) for a in done]}"
                )
            elif len(fresh) > 1:
                check.fail(
                    f"({owner}, {key}): {len(fresh)} non-replayed 2xx answers: "
                    f"{[r['id'] for r in fresh]}"
                )
            else:
                check.ok()
        return check

    def owner_isolation(self) -> Check:
        check = Check(
            "owner_isolation",
            "every answer the backend produced went to the owner it was produced for, for the "
            "key and the payload it was produced for; a job id in an answer is the requester's",
        )
        for record in self.answered:
            echo = record.get("echo")
            problems = []
            if echo is not None:
                for name in ("owner", "key", "payload_sha"):
                    if echo.get(name) != record[name]:
                        problems.append(f"{name} {echo.get(name)} != {record[name]}")
            if record.get("job"):
                stored = self.jobs_final.get((record["owner"], record["key"]))
                if stored is None or stored["id"] != record["job"]:
                    problems.append(
                        f"job header {record['job']} is not the requester's job "
                        f"{stored and stored['id']}"
                    )
            if echo is None and not record.get("job"):
                continue
            if problems:
                check.fail(
                    f"request {record['id']} ({record['owner']}, {record['key']}): "
                    + "; ".join(problems)
                )
            else:
                check.ok()
        return check

    def payload_mismatch_justified(self) -> Check:
        check = Check(
            "payload_mismatch_justified",
            "409 payload-mismatch only for a payload other than the job's, and a payload equal "
            "to the job's never gets it",
        )
        sent: dict[tuple[str, str], set[str]] = defaultdict(set)
        for record in self.history:
            sent[(record["owner"], record["key"])].add(record["payload_sha"])
        for record in self.answered:
            if record.get("problem") != "payload-mismatch":
                continue
            intent = (record["owner"], record["key"])
            arrivals = self.by_intent.get(intent, [])
            if arrivals:
                if record["payload_sha"] == arrivals[0]["payload_sha"]:
                    check.fail(f"request {record['id']}: mismatch for the job's own payload")
                else:
                    check.ok()
            elif len(sent[intent]) < 2:
                check.fail(
                    f"request {record['id']}: mismatch, but only one payload was ever "
                    f"sent for {intent}"
                )
            else:
                check.ok()
        return check

    def store_agrees_with_ledger(self) -> Check:
        check = Check(
            "store_agrees_with_ledger",
            "a completed job executed exactly once, by the attempt that completed it, and "
            "stores that execution's status and body; a released job never executed; every "
            "job the backend saw exists",
        )
        for job in self.store_final["jobs"]:
            done = self.executed(job["id"])
            if job["state"] == "completed":
                if len(done) != 1:
                    check.fail(f"completed job {job['id']} executed {len(done)} times")
                elif (done[0]["attempt"], done[0]["status"], done[0]["body_sha"]) != (
                    job["completed_by"],
                    job["response_status"],
                    job["body_sha"],
                ):
                    check.fail(
                        f"completed job {job['id']} stores attempt "
                        f"{job['completed_by']} status {job['response_status']} body "
                        f"{job['body_sha']}; execution {done[0]}"
                    )
                else:
                    check.ok()
            elif job["state"] == "released" and done:
                check.fail(f"released job {job['id']} executed: seq {[a['seq'] for a in done]}")
            else:
                check.ok()
        for job in self.by_job:
            if job not in self.jobs_by_id:
                check.fail(f"job {job} reached the backend but is not in the store")
        return check

    def no_stuck_in_flight(self) -> Check:
        check = Check(
            "no_stuck_in_flight",
            "after a quiet period longer than the lease no job holds a live lease; each job "
            "still in flight past its lease is taken over as unknown by the next request "
            "(409 outcome-unknown) without a forward; none is in flight afterwards",
        )
        final_start = self.run.get("final_phase_started_at", float("inf"))
        final = [r for r in self.history if r.get("phase") == "final"]
        stale = 0
        for job in self.store_end["jobs"]:
            if job["state"] != "in_flight":
                continue
            if job["lease_left"] is None or job["lease_left"] > 0:
                check.fail(
                    f"job {job['id']} in flight with a live lease "
                    f"({job['lease_left']} s left) after the quiet period"
                )
                continue
            stale += 1
            marker = marker_of_store_owner(job["owner"])
            tries = [r for r in final if (r["owner"], r["key"]) == (marker, job["key"])]
            answers = {(r.get("status"), r.get("problem")) for r in tries}
            after = self.jobs_by_id.get(job["id"])
            if (409, "outcome-unknown") not in answers:
                check.fail(f"stale job {job['id']}: the retries got {sorted(map(str, answers))}")
            elif after is None or after["state"] != "unknown":
                check.fail(f"stale job {job['id']}: {after and after['state']} after the retry")
            else:
                check.ok()
        late = [a["seq"] for a in self.ledger if a["at"] >= final_start]
        if late:
            check.fail(f"the final retries were forwarded: seq {late}")
        still = [j["id"] for j in self.store_final["jobs"] if j["state"] == "in_flight"]
        if still:
            check.fail(f"{len(still)} jobs still in flight at the very end: {still[:5]}")
        check.ok()
        check.notes.append(f"{stale} jobs were in flight past their lease after the quiet period")
        return check

    def answers_well_formed(self) -> Check:
        check = Check(
            "answers_well_formed",
            "every answer is the backend's own (201, or the 502/503/504 it was asked for) or "
            "a problem+json with a known code and its status; replays are 201s",
        )
        for record in self.answered:
            status, problem, echo = record["status"], record.get("problem"), record.get("echo")
            if problem is not None:
                good = (
                    PROBLEM_STATUS.get(problem) == status
                    and record.get("content_type") == "application/problem+json"
                    and not record.get("replayed")
                )
            else:
                good = echo is not None and status in BACKEND_STATUSES
                if record.get("replayed"):
                    good = good and status == 201
            if good:
                check.ok()
            else:
                check.fail(
                    f"request {record['id']}: status {status} problem {problem} "
                    f"content-type {record.get('content_type')} replayed "
                    f"{record.get('replayed')} backend body {echo is not None}"
                )
        return check

    def every_request_completed(self) -> Check:
        bound = float(self.run["client_timeout"]) + 2.0
        check = Check(
            "every_request_completed",
            f"every request ended (answer, error or timeout) within {bound:.0f} s",
        )
        for record in self.history:
            if record["outcome"] == "invoked" or record.get("seconds", 0) > bound:
                check.fail(
                    f"request {record['id']}: {record['outcome']} after {record.get('seconds')} s"
                )
            else:
                check.ok()
        return check

    def pg_connections_bounded(self) -> Check:
        limit = int(self.run["pool"]) + 1
        check = Check(
            "pg_connections_bounded",
            f"after the load, each live proxy holds at most pool + listener = {limit} "
            "PostgreSQL connections, and no connection of a killed incarnation is left",
        )
        live = {f"soak-{name}-{self.final_incarnation(name)}" for name in ("a", "b")}
        ends = [s for s in self.samples if s["phase"] in ("after-quiet", "final")]
        for sample in ends:
            counts = sample.get("pg_connections")
            if counts is None:
                check.fail(f"sample at {sample['at']}: pg_stat_activity unreadable")
                continue
            for name, count in counts.items():
                if not name.startswith("soak-") or name == "soak-checker":
                    continue
                if name not in live:
                    check.fail(f"sample at {sample['at']}: {count} connections of {name}")
                elif count > limit:
                    check.fail(f"sample at {sample['at']}: {name} holds {count} > {limit}")
                else:
                    check.ok()
        over = [
            (s["at"], name, count)
            for s in self.samples
            if s["phase"] == "load"
            for name, count in (s.get("pg_connections") or {}).items()
            if name.startswith("soak-") and count > limit
        ]
        peak = max(
            (
                c
                for s in self.samples
                for n, c in (s.get("pg_connections") or {}).items()
                if n.startswith("soak-") and n != "soak-checker"
            ),
            default=0,
        )
        check.notes.append(f"peak per incarnation during the load: {peak}")
        if over:
            check.notes.append(
                f"{len(over)} load samples over {limit} (sessions being "
                f"replaced after a kill): {over[:5]}"
            )
        return check

    def final_incarnation(self, name: str) -> int:
        started = [e for e in self.events if e["event"] == "proxy-started" and e["proxy"] == name]
        return max((e["incarnation"] for e in started), default=0)

    def fd_stable(self) -> tuple[Check, dict[str, Any]]:
        check = Check(
            "fd_stable",
            "the surviving proxy (b, never killed) holds no more file descriptors after the "
            "load than in the middle of it, within a margin of max(16, 25 %)",
        )
        series = [(s["at"], s["phase"], s["b"]["fds"]) for s in self.samples if s.get("b")]
        pids = {s["b"]["pid"] for s in self.samples if s.get("b")}
        info: dict[str, Any] = {"pids": sorted(pids)}
        load = [x for x in series if x[1] == "load" and x[2] is not None]
        ends = [x for x in series if x[1] == "after-quiet" and x[2] is not None]
        if len(pids) != 1 or not load or not ends:
            check.applicable = False
            check.fail(f"no single surviving process to compare (pids {sorted(pids)})")
            return check, info
        middle_at = float(self.run.get("load_ended_at", load[-1][0])) / 2
        mid = min(load, key=lambda x: abs(x[0] - middle_at))
        end = ends[-1]
        margin = max(16, int(mid[2] * 0.25))
        info.update(
            mid={"at": mid[0], "fds": mid[2]},
            end={"at": end[0], "fds": end[2]},
            load_min=min(x[2] for x in load),
            load_max=max(x[2] for x in load),
            margin=margin,
        )
        last_load = load[-1]
        info["last_load"] = {"at": last_load[0], "fds": last_load[2]}
        if end[2] > mid[2] + margin:
            check.fail(f"fds {mid[2]} at {mid[0]} s, {end[2]} after the load (margin {margin})")
        else:
            check.ok()
        rss = [s["b"]["rss_kib"] for s in self.samples if s.get("b") and s["b"]["rss_kib"]]
        if rss:
            info["rss_kib"] = {"first": rss[0], "max": max(rss), "last": rss[-1]}
        return check, info

    def clean_shutdown(self) -> Check:
        check = Check("clean_shutdown", "both proxies exit 0 on SIGTERM at the end")
        for name, exit_ in sorted(self.run.get("exits", {}).items()):
            if exit_["code"] == 0:
                check.ok()
            else:
                check.fail(f"proxy {name} exited {exit_['code']} after {exit_['seconds']} s")
        return check

    # -- statistics ------------------------------------------------------------------------

    def statistics(self) -> dict[str, Any]:
        load = [r for r in self.history if r.get("phase") == "load"]
        answers = Counter(
            f"{r['status']} {r.get('problem') or ('backend' if r.get('echo') else '-')}"
            + (" replayed" if r.get("replayed") else "")
            for r in load
            if r.get("status") is not None
        )
        errors = Counter(
            (r.get("error") or "").split(":")[0] for r in load if r.get("status") is None
        )
        latency = {}
        for outcome in ("ok", "failed", "indeterminate"):
            seconds = sorted(r["seconds"] for r in load if r["outcome"] == outcome)
            if seconds:
                latency[outcome] = {
                    "n": len(seconds),
                    "p50": _pct(seconds, 50),
                    "p95": _pct(seconds, 95),
                    "p99": _pct(seconds, 99),
                    "max": seconds[-1],
                }
        intents = {(r["owner"], r["key"]) for r in load}
        executed = [a for a in self.ledger if a["executed"]]
        events = Counter(e["event"] for e in self.events)
        terminated = sum(e.get("sessions", 0) for e in self.events if e["event"] == "pg-terminate")
        restarts = Counter(e["mode"] for e in self.events if e["event"] == "pg-restart")
        refused = [e["seconds"] for e in self.events if e["event"] == "upstream-refuse"]
        resets_injected = sum(
            e["connections"] for e in self.events if e["event"] == "upstream-reset-on-accept"
        )
        relay = self.run.get("relay", {})
        loads = [s["load"][0] for s in self.samples if s.get("load")]
        return {
            "requests": {
                "total": len(load),
                "by_outcome": dict(Counter(r["outcome"] for r in load)),
                "by_kind": dict(Counter(r["kind"] for r in load)),
                "by_proxy": dict(Counter(r["proxy"] for r in load)),
                "answers": dict(answers.most_common()),
                "no_answer": dict(errors.most_common()),
                "replayed": sum(1 for r in load if r.get("replayed")),
                "owners": len({r["owner"] for r in load}),
                "keys": len({r["key"] for r in load}),
                "owner_key_pairs": len(intents),
                "final_phase": len(self.history) - len(load),
                "latency_seconds": latency,
                "per_second": round(len(load) / max(float(self.run.get("load_ended_at", 1)), 1), 1),
            },
            "executions": {
                "arrivals": len(self.ledger),
                "executed": len(executed),
                "not_executed_503": len(self.ledger) - len(executed),
                "jobs_reaching_backend": len(self.by_job),
                "jobs_executed": len({a["job"] for a in executed}),
                "by_status": dict(Counter(a["status"] for a in self.ledger)),
            },
            "faults": {
                "requests_by_planned_fault": dict(Counter(r["fault"] for r in load)),
                "relay_faults_applied": relay.get("applied", {}),
                "backend_statuses_sent": {
                    str(s): n
                    for s, n in Counter(a["status"] for a in self.ledger).items()
                    if s != 201
                },
                "upstream_refuse_windows": len(refused),
                "upstream_refuse_seconds": round(sum(refused), 2),
                "upstream_resets_on_accept": resets_injected
                - int(relay.get("resets_on_accept_left", 0)),
                "pg_terminate_rounds": events.get("pg-terminate", 0),
                "pg_sessions_terminated": terminated,
                "pg_restarts": dict(restarts),
                "proxy_sigkills": events.get("proxy-sigkill", 0),
                "proxy_start_failures": events.get("proxy-start-failed", 0),
            },
            "store": {
                "end": dict(Counter(j["state"] for j in self.store_end["jobs"])),
                "final": dict(Counter(j["state"] for j in self.store_final["jobs"])),
                "attempts_final": dict(Counter(a["state"] for a in self.store_final["attempts"])),
                "attempts_by_reason": {
                    f"{state} {status or '-'} {error or ''}".strip(): n
                    for (state, status, error), n in Counter(
                        (a["state"], a["status"], _MASK.sub("#", a["error"] or ""))
                        for a in self.store_final["attempts"]
                    ).most_common()
                },
            },
            "load_average": {
                "start": self.run.get("load_start"),
                "min_1m": min(loads, default=None),
                "mean_1m": round(statistics.fmean(loads), 2) if loads else None,
                "max_1m": max(loads, default=None),
                "cpus": self.run.get("cpus"),
            },
        }


def log_findings(directory: Path) -> dict[str, Any]:
    """What the proxies logged at WARNING and above, by kind (ids and numbers masked)."""
    levels: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    tracebacks: Counter[str] = Counter()
    for path in sorted((directory / "logs").glob("soak-*.stderr")):
        lines = path.read_text(errors="replace").splitlines()
        for number, line in enumerate(lines):
            match = _LOG_LINE.match(line)
            if match is None:
                if line.startswith("Traceback"):
                    # The exception is the first unindented line after the traceback.
                    last = next(
                        (x for x in lines[number + 1 :] if x and not x.startswith(" ")), "?"
                    )
                    tracebacks[_MASK.sub("#", last)[:140]] += 1
                continue
            level, message = match.groups()
            if level in ("WARNING", "ERROR", "CRITICAL"):
                levels[level] += 1
                kinds[f"{level} {_MASK.sub('#', message)[:140]}"] += 1
    return {
        "levels": dict(levels),
        "kinds": dict(kinds.most_common(25)),
        "tracebacks": dict(tracebacks.most_common(10)),
    }


_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ (\w+) (.*)$")
_MASK = re.compile(r"[0-9a-f]{8}-[0-9a-f-]{27}|\d+(\.\d+)?")


def _pct(values: list[float], pct: int) -> float:
    return values[min(len(values) - 1, int(len(values) * pct / 100))]


def check_dir(directory: Path) -> dict[str, Any]:
    soak = Soak(directory)
    fd_check, fds = soak.fd_stable()
    checks = [
        soak.single_execution(),
        soak.one_job_per_key(),
        soak.no_forward_after_execution(),
        soak.identical_bodies(),
        soak.owner_isolation(),
        soak.payload_mismatch_justified(),
        soak.store_agrees_with_ledger(),
        soak.no_stuck_in_flight(),
        soak.answers_well_formed(),
        soak.every_request_completed(),
        soak.pg_connections_bounded(),
        fd_check,
        soak.clean_shutdown(),
    ]
    results = [c.result() for c in checks]
    report = {
        "passed": all(r["passed"] for r in results),
        "run": soak.run,
        "statistics": soak.statistics(),
        "file_descriptors": fds,
        "checks": results,
        "proxy_logs": log_findings(directory),
    }
    (directory / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (directory / "report.md").write_text(markdown(report))
    return report


def summary_line(report: dict[str, Any]) -> str:
    failed = [c["name"] for c in report["checks"] if not c["passed"]]
    stats = report["statistics"]
    return (
        f"soak: {stats['requests']['total']} requests, {stats['executions']['executed']} "
        f"executions; {len(report['checks']) - len(failed)}/{len(report['checks'])} checks "
        f"passed" + (f"; FAILED: {', '.join(failed)}" if failed else "")
    )


def _table(header: Iterable[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return [*lines, ""]


def markdown(report: dict[str, Any]) -> str:
    run, stats = report["run"], report["statistics"]
    req, exe, faults = stats["requests"], stats["executions"], stats["faults"]
    verdict = "PASSED" if report["passed"] else "FAILED"
    lines = [
        f"# Soak test report: {verdict}",
        "",
        f"{run['minutes']} min of load, {run['clients']} clients, seed {run['seed']}, started "
        f"{run['started_utc']} at git {run['git_head']}"
        + (
            f" (uncommitted changes in {len(run['git_dirty_src'])} src files)"
            if run.get("git_dirty_src")
            else ""
        )
        + f". Lease {run['lease']} s, upstream timeout {run['upstream_timeout']} s, pool "
        f"{run['pool']}, client timeout {run['client_timeout']} s, quiet period "
        f"{run['quiet']} s. Load average (1 min) on {stats['load_average']['cpus']} CPUs: "
        f"{stats['load_average']['min_1m']:.2f} to {stats['load_average']['max_1m']:.2f} "
        f"(mean {stats['load_average']['mean_1m']}).",
        "",
        "## Invariants",
        "",
    ]
    lines += _table(
        ["check", "result", "checked", "violations"],
        (
            (c["name"], "pass" if c["passed"] else "**FAIL**", c["checked"], c["violations"])
            for c in report["checks"]
        ),
    )
    for c in report["checks"]:
        lines.append(f"* `{c['name']}`: {c['claim']}.")
        lines += [f"  * {note}" for note in c["notes"]]
        lines += [f"  * violation: {example}" for example in c["examples"]]
    lines += ["", "## Requests", ""]
    lines += _table(
        ["outcome", "requests"],
        [
            *sorted(req["by_outcome"].items()),
            ("total", req["total"]),
            ("per second", req["per_second"]),
        ],
    )
    lines += _table(["answer (status, problem or backend)", "requests"], req["answers"].items())
    lines += _table(["no answer", "requests"], req["no_answer"].items())
    lines += _table(
        ["outcome", "n", "p50 s", "p95 s", "p99 s", "max s"],
        (
            (o, v["n"], v["p50"], v["p95"], v["p99"], v["max"])
            for o, v in req["latency_seconds"].items()
        ),
    )
    lines.append(
        f"{req['owners']} owners, {req['keys']} keys, {req['owner_key_pairs']} (owner, key) "
        f"pairs; by kind {req['by_kind']}; by proxy {req['by_proxy']}; "
        f"{req['final_phase']} retries of stale jobs after the load."
    )
    lines += ["", "## Executions", ""]
    lines += _table(["", "count"], exe.items())
    lines += ["## Faults injected", ""]
    lines += _table(["fault", "count"], faults.items())
    lines += ["## Store at the end", ""]
    store = dict(stats["store"])
    reasons = store.pop("attempts_by_reason")
    lines += _table(["", "states"], store.items())
    lines += _table(["attempt (state, status, error)", "attempts"], reasons.items())
    lines += ["## Surviving proxy", ""]
    lines += [f"`{json.dumps(report['file_descriptors'])}`", ""]
    logs = report["proxy_logs"]
    lines += ["## What the proxies logged (WARNING and above)", ""]
    lines += _table(["level", "lines"], logs["levels"].items())
    lines += _table(["kind (numbers and ids masked)", "lines"], logs["kinds"].items())
    lines += _table(["traceback ending in", "count"], logs["tracebacks"].items())
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    result = check_dir(Path(sys.argv[1]))
    print(summary_line(result))
    sys.exit(0 if result["passed"] else 1)
