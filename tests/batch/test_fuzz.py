"""Fuzz: `idemproxy batch run` processes, SIGKILLed at random moments, against the real proxy and
an upstream answering arbitrary bytes, depths and sizes; input files with a hostile line.

What must hold whatever is drawn (SPEC §14):
* an input file with a line that could not be sent or written is refused before anything is
  sent, naming that line, and no results file is made;
* otherwise, once a run finishes, every item has exactly one result line, every line is read by
  a strict JSON parser, every item executed exactly once upstream, and each line says truly
  what the upstream answered (its status, and its bytes, or `omitted` for a replay of a body
  over the proxy's max_stored_body).

Examples are drawn the same way on every run (the "repeatable" profile, tests/conftest.py), and
bounded: eight examples of at most ten items, three kills each (about half a minute).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.support.ports import free_port
from tests.support.processes import START_DEADLINE

from .rawserver import RawAnswer, RawUpstream, raw_upstream
from .servers import line_count, read_results, write_jsonl
from .test_hostile import strict_results

pytestmark = pytest.mark.slow

STORED_LIMIT = 1024  # the proxy's max_stored_body: larger answers replay as `omitted`
_examples = count()


@dataclass(frozen=True)
class Proxy:
    url: str
    upstream_port: int
    folder: Path


@contextmanager
def running_proxy(folder: Path) -> Iterator[Proxy]:
    """`idemproxy serve` for the whole test; the upstream comes and goes with each example."""
    port, upstream_port = free_port(), free_port()
    env = {
        **os.environ,
        "IDEMPROXY_ADMIN__LISTEN": "127.0.0.1:0",
        "IDEMPROXY_MAX_STORED_BODY": str(STORED_LIMIT),
    }
    log = folder / "proxy.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "idemproxy", "serve", "--listen", f"127.0.0.1:{port}",
             "--upstream", f"http://127.0.0.1:{upstream_port}",
             "--store", f"sqlite:///{folder}/idemproxy.db"],
            stdout=sink, stderr=sink, env=env,
        )  # fmt: skip
    try:
        _wait_listening(port, process, log)
        yield Proxy(f"http://127.0.0.1:{port}", upstream_port, folder)
    finally:
        process.terminate()
        process.wait(10)


def _wait_listening(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    until = time.monotonic() + START_DEADLINE  # a bound in time: tries take long under load
    while True:
        assert process.poll() is None, log.read_text()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < until, f"the proxy did not start: {log.read_text()}"
            time.sleep(0.05)


# --- what the upstream answers ---------------------------------------------------------------

_JSONISH = (b"application/json", b"application/problem+json")
_TYPES = st.sampled_from([*_JSONISH, b"text/plain; charset=utf-8", b"application/octet-stream"])


@st.composite
def _bodies(draw: st.DrawFn) -> bytes:
    depth = draw(st.integers(1, 100_000))
    kinds = ["bytes", "deep", "surrogate", "nan", "number", "big", "big", "json"]
    kind = draw(st.sampled_from(kinds))
    if kind == "deep":
        return b"[" * depth + b"]" * depth
    if kind == "surrogate":
        return b'{"text":"caf\\u%s"}' % draw(st.sampled_from([b"d83d", b"dc00", b"dbff"]))
    if kind == "nan":
        return draw(st.sampled_from([b"[NaN]", b'{"x": Infinity}', b"-Infinity", b"1e999"]))
    if kind == "number":
        return b"9" * draw(st.integers(1, 6000))
    if kind == "big":
        return b'{"pad": "%s"}' % (b"y" * draw(st.integers(STORED_LIMIT, 40 * STORED_LIMIT)))
    if kind == "json":
        return json.dumps(draw(_json_values)).encode()
    return draw(st.binary(max_size=3 * STORED_LIMIT))


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip

_answers = st.builds(
    RawAnswer,
    status=st.sampled_from([200, 200, 201, 400, 409, 422, 500]),
    headers=_TYPES.map(lambda media: (b"Content-Type: " + media,)),
    body=_bodies(),
    flaky=st.booleans(),
    delay=st.sampled_from([0.0, 0.1, 0.3, 0.6]),
)

# --- what the input holds -------------------------------------------------------------------

_header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20)
_items = st.fixed_dictionaries(
    {"id": st.text(min_size=1, max_size=30)},
    optional={"meta": _json_values, "headers": st.dictionaries(
        st.sampled_from(["X-Trace", "X-Chapter"]), _header_text, max_size=2)},
)  # fmt: skip


@st.composite
def _hostile_lines(draw: st.DrawFn) -> bytes:
    """One input line that must be refused (it could not be sent, or not written back)."""
    base = {"id": "hostile", "method": "POST", "path": "/refused"}
    control = chr(draw(st.sampled_from([*range(0, 9), *range(10, 32), 127])))
    hostile: list[dict[str, Any]] = [
        {**base, "id": "caf\ud83d"},
        {**base, "meta": {"note": "\udfff"}},
        {**base, "body": ["\udbff"]},
        {**base, "headers": {"X-Note": f"a{control}b"}},
    ]
    choice = draw(st.integers(0, len(hostile) + 1))
    if choice < len(hostile):
        return json.dumps(hostile[choice]).encode()  # escapes the surrogates: \udfff
    if choice == len(hostile):
        depth = draw(st.integers(50_000, 100_000))
        return b'{"id": "deep", "method": "POST", "path": "/x", "body": %s}' % (
            b"[" * depth + b"]" * depth
        )
    raw = draw(st.binary(min_size=1, max_size=200)).replace(b"\n", b" ")
    return raw if raw.strip() else b"\x00"


@dataclass(frozen=True)
class Kill:
    lines: int  # SIGKILL once the results file has this many lines (or the run ended) …
    after: float  # … and this many seconds more
    torn: float | None  # then cut the last line at this fraction, as a power cut may


@dataclass(frozen=True)
class Example:
    items: list[dict[str, Any]]
    answers: list[RawAnswer]
    kills: list[Kill]
    hostile: tuple[int, bytes] | None  # (position, line)


@st.composite
def _examples_of(draw: st.DrawFn) -> Example:
    items = draw(st.lists(_items, min_size=1, max_size=10, unique_by=lambda item: str(item["id"])))
    answers = draw(st.lists(_answers, min_size=len(items), max_size=len(items)))
    kill = st.builds(
        Kill,
        lines=st.integers(0, len(items)),
        after=st.floats(0, 0.4),
        torn=st.none() | st.floats(0.01, 0.99),
    )
    kills = draw(st.lists(kill, max_size=3))
    hostile = None
    if draw(st.integers(0, 4)) == 0:
        hostile = (draw(st.integers(0, len(items))), draw(_hostile_lines()))
    return Example(items, answers, kills, hostile)


# --- the test -------------------------------------------------------------------------------


def test_every_item_ends_with_one_result_line_and_one_execution(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    with running_proxy(tmp_path_factory.mktemp("proxy")) as proxy:
        # No shrinking: each example runs processes for seconds, and the failing example is
        # printed as drawn.
        @settings(
            max_examples=8,
            deadline=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(example=_examples_of())
        def check(example: Example) -> None:
            folder = proxy.folder / f"example-{next(_examples)}"
            folder.mkdir()
            asyncio.run(_play(example, proxy, folder))

        check()


async def _play(example: Example, proxy: Proxy, folder: Path) -> None:
    paths = [f"/{folder.name}/{n}" for n in range(len(example.items))]
    upstream = RawUpstream(dict(zip(paths, example.answers, strict=True)))
    items = [
        {**item, "method": "POST", "path": path, "body": {"n": n}}
        for n, (item, path) in enumerate(zip(example.items, paths, strict=True))
    ]
    source = write_jsonl(folder / "in.jsonl", items)
    if example.hostile is not None:
        position, line = example.hostile
        lines = source.read_bytes().splitlines(keepends=True)
        lines.insert(position, line + b"\n")
        source.write_bytes(b"".join(lines))
    out, log = folder / "out.jsonl", folder / "batch.log"
    async with raw_upstream(upstream, proxy.upstream_port):
        if example.hostile is not None:
            await _refused(source, out, proxy.url, log, example.hostile[0] + 1, upstream)
            return
        for kill in example.kills:
            await _killed(source, out, proxy.url, log, kill)
        status = await _run(source, out, proxy.url, log)
        assert status in (0, 1), log.read_text()
        _check(items, example.answers, upstream, out, status)


async def _refused(
    source: Path, out: Path, url: str, log: Path, line: int, upstream: RawUpstream
) -> None:
    assert await _run(source, out, url, log) == 2
    said = log.read_text()  # noqa: ASYNC240 - the run has ended; nothing else runs meanwhile
    assert f"line {line}: " in said and "Traceback" not in said, said
    assert not out.exists() and not upstream.calls  # noqa: ASYNC240


async def _start(source: Path, out: Path, url: str, log: Path) -> asyncio.subprocess.Process:
    with log.open("ab") as sink:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "idemproxy", "batch", "run", str(source), "--target", url,
            "--output", str(out), "--concurrency", "4", "--timeout", "20", "--no-progress",
            stdout=sink, stderr=sink,
        )  # fmt: skip


async def _run(source: Path, out: Path, url: str, log: Path) -> int:
    return await (await _start(source, out, url, log)).wait()


async def _killed(source: Path, out: Path, url: str, log: Path, kill: Kill) -> None:
    process = await _start(source, out, url, log)
    try:
        # A bound on a hung run, never waited out by one that works: its start (a loaded
        # machine may take many seconds over a python start) and one request's --timeout.
        deadline = time.monotonic() + START_DEADLINE + 20
        while process.returncode is None and line_count(out) < kill.lines:
            assert time.monotonic() < deadline, "the run neither ended nor wrote"
            await asyncio.sleep(0.005)  # another process writes the file: polling is all
        await asyncio.sleep(kill.after)
    finally:  # a failed wait too: the run never outlives the example
        if process.returncode is None:
            process.send_signal(signal.SIGKILL)
        await process.wait()
    if kill.torn is not None:
        _tear_last_line(out, kill.torn)


def _tear_last_line(out: Path, fraction: float) -> None:
    """Keep only the start of the last line (unsynced bytes lost in a power cut)."""
    if not out.exists():
        return
    data = out.read_bytes()
    start = data.rstrip(b"\n").rfind(b"\n") + 1
    if start >= len(data):
        return
    out.write_bytes(data[: start + max(1, int((len(data) - start - 1) * fraction))])


def _check(
    items: list[dict[str, Any]],
    answers: list[RawAnswer],
    upstream: RawUpstream,
    out: Path,
    status: int,
) -> None:
    lines = strict_results(out)
    assert sorted(r["id"] for r in lines) == sorted(item["id"] for item in items)
    assert read_results(out) == lines
    by_id = {r["id"]: r for r in lines}
    for item, answer in zip(items, answers, strict=True):
        assert upstream.executions[item["path"]] == 1, item
        _same_answer(by_id[item["id"]], answer)
    assert (status == 0) == all(r["outcome"] == "done" for r in lines)


def _same_answer(result: dict[str, Any], answer: RawAnswer) -> None:
    assert result["status"] == answer.status, result
    if result["outcome"] == "omitted":
        assert result["replayed"] and len(answer.body) > STORED_LIMIT and result["body"] is None
        return
    assert result["outcome"] == ("done" if answer.status < 400 else "failed"), result
    assert not result["retryable"]
    body, encoding = result["body"], result["body_encoding"]
    if encoding == "json":  # parsed: compared as a value (spacing and key order are not kept)
        assert body == json.loads(answer.body)
    elif encoding == "base64":
        assert base64.b64decode(body) == answer.body
    elif encoding == "text":
        assert body.encode() == answer.body
    else:
        assert encoding == "none" and answer.body == b""
