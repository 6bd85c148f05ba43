"""Readable text for `idemproxy jobs list` and `show`, rendered from the JSON view so that
both outputs always show the same data."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from idemproxy.ops.view import JsonObject

_LIST_COLUMNS = ("ID", "STATE", "VER", "ATT", "STATUS", "KEY", "OWNER", "UPDATED", "RESOLUTION")
_ATTEMPT_COLUMNS = ("#", "UPSTREAM", "STATE", "STATUS", "STARTED", "FINISHED", "ERROR")
_EVIDENCE_COLUMNS = ("WAY", "ASKED", "ANSWERED", "STATUS", "VERDICT", "REASON")
_KEY_WIDTH = 32
_OWNER_WIDTH = 16


def jobs_table(jobs: Sequence[JsonObject]) -> str:
    if not jobs:
        return "no jobs"
    rows = [
        [
            job["id"],
            job["state"],
            job["version"],
            job["attempt_count"],
            job["response_status"],
            _shorten(job["key"], _KEY_WIDTH),
            _shorten(job["owner"], _OWNER_WIDTH),
            _time(job["updated_at"]),
            job["resolution"],
        ]
        for job in jobs
    ]
    return _table(_LIST_COLUMNS, rows)


def job_details(job: JsonObject) -> str:
    fields = [
        ("job", job["id"]),
        ("state", f"{job['state']} (version {job['version']})"),
        ("owner", job["owner"]),
        ("key", job["key"]),
        ("request", f"{job['method']} {job['path']}"),
        ("created", _time(job["created_at"])),
        ("updated", _time(job["updated_at"])),
        ("expires", _time(job["expires_at"]) + (" (expired)" if job["expired"] else "")),
        ("resolution", job["resolution"]),
        ("completed by", _completed_by(job["completed_by"], job["resolution"])),
        ("response", _response_line(job)),
    ]
    width = max(len(name) for name, _ in fields)
    lines = [f"{name:<{width}}  {_cell(value)}" for name, value in fields]
    lines += _response_details(job.get("response"))
    attempts = [
        [a["number"], a["upstream"], a["state"], a["status"], _time(a["started_at"]),
         _time(a["finished_at"]), a["error"]]
        for a in job["attempts"]
    ]  # fmt: skip
    lines += ["", "attempts", _indent(_table(_ATTEMPT_COLUMNS, attempts)) if attempts else "  none"]
    lines += _late_lines(job["attempts"])
    lines += _evidence_lines(job["attempts"])
    return "\n".join(lines)


def _evidence_lines(attempts: Sequence[JsonObject]) -> list[str]:
    """SPEC §3.6: what the proxy asked about an unknown attempt, and what it was answered."""
    lines = []
    for attempt in attempts:
        checks, evidence = attempt.get("checks"), attempt.get("evidence")
        if not checks and not evidence:
            continue
        # `checks` counts the reconcile endpoint's questions; a resend under the key the
        # upstream honours is evidence too, and counts none.
        times = f" {checks} time(s)" if checks else ""
        lines += ["", f"attempt {attempt['number']} asked about{times}"]
        rows = [
            [e["way"], _time(e["asked_at"]), _time(e["answered_at"]), e["status"], e["verdict"],
             e["reason"]]
            for e in evidence or ()
        ]  # fmt: skip
        if rows:
            lines.append(_indent(_table(_EVIDENCE_COLUMNS, rows)))
    return lines


def _late_lines(attempts: Sequence[JsonObject]) -> list[str]:
    """SPEC §3.3: responses that came after the job was taken over, kept for the operator."""
    lines = []
    for attempt in attempts:
        size = attempt.get("late_response_bytes")
        if size is None:
            continue
        lines += ["", f"attempt {attempt['number']} answered too late; its response was kept"]
        late = attempt.get("late_response")
        if late is None:
            lines.append(f"  {size} bytes of body (--include-response shows it)")
        else:
            lines.append(f"  status {late['status']}")
            lines += _response_details(late)
        lines.append(f"  resolve with it: --as completed --from-attempt {attempt['number']}")
    return lines


def _response_line(job: JsonObject) -> str:
    if job["response_status"] is None:
        return "-"
    if "response" in job:
        return str(job["response_status"])
    return f"{job['response_status']} (headers and body not shown: --include-response)"


def _response_details(response: JsonObject | None) -> list[str]:
    if response is None:
        return []
    lines = [f"  {pair[0]}: {_cell(pair[1])}" for pair in response["headers"]]
    if "reason" in response:  # the upstream's own phrase (SPEC §7)
        lines.insert(0, f"  (reason phrase: {_cell(response['reason'])})")
    if response["omitted"]:
        lines.append("  (body not stored: it was over max_stored_body)")
    elif "body" in response:
        lines += ["", *(_cell(line) for line in response["body"].splitlines())]
    else:
        lines.append("  (binary body: see --json, body_base64)")
    return lines


def _completed_by(number: int | None, resolution: str | None) -> str:
    if number is None:
        return "-"
    # 0: a resolution's response (SPEC §3.3, §3.6): an operator's, or the reconcile endpoint's.
    return (resolution or "operator") if number == 0 else f"attempt {number}"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(header), *([_cell(value) for value in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in cells
    )


def _cell(value: Any) -> str:
    """One printable line: nothing a stored value holds can move the cursor."""
    if value is None:
        return "-"
    return "".join(ch if ch.isprintable() else "?" for ch in str(value))


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _time(value: str | None) -> str:
    """`2024-05-01T12:00:03.123456+00:00` → `2024-05-01 12:00:03Z` (the view is always UTC)."""
    return "-" if value is None else value[:19].replace("T", " ") + "Z"


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())
