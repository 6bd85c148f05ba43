"""Bounded memory: the proxy's resident set while it holds many duplicates, and while it takes
many big request bodies at once. These are about memory, not throughput, so the client is a
plain asyncio one (aiohttp) rather than wrk.

The proxy under test is a fresh process for each test, so that its high-water mark (VmHWM in
/proc/PID/status) belongs to that test alone; VmRSS is also sampled every 20 ms.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

MIB = 1024 * 1024
HEADERS = {"Content-Type": "application/json"}
BODY = b'{"amount":1250,"currency":"EUR","note":"bench"}'


@dataclass
class MemoryResult:
    name: str
    title: str
    requests: int
    seconds: float
    statuses: dict[int, int]
    replayed: int
    upstream_calls: int
    rss_idle_mb: float  # VmRSS of the fresh proxy before the test
    rss_peak_mb: float  # the largest VmRSS sampled during the test
    hwm_mb: float  # VmHWM at the end: the peak resident set of the process's whole life
    held_peak: int = 0  # the proxy's waiters gauge at its highest (hold test)
    notes: list[str] = field(default_factory=list)


def status_kib(pid: int, name: str) -> int:
    """A `Vm…` line of /proc/PID/status, in KiB (0 when the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    return 0


class RssSampler:
    """The largest VmRSS of a process, sampled from a thread (the event loop may be busy)."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid = pid
        self.interval = interval
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, status_kib(self.pid, "VmRSS"))
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_kib = max(self.peak_kib, status_kib(self.pid, "VmRSS"))


async def _get_json(session: aiohttp.ClientSession, url: str) -> dict[str, int]:
    async with session.get(url) as response:
        data: dict[str, int] = await response.json(content_type=None)
        return data


async def _waiters(session: aiohttp.ClientSession, admin_url: str) -> int:
    async with session.get(admin_url + "/metrics") as response:
        text = await response.text()
    for line in text.splitlines():
        if line.startswith("idemproxy_waiters "):
            return int(float(line.split()[1]))
    raise RuntimeError("the proxy's /metrics has no idemproxy_waiters gauge")


async def _post(
    session: aiohttp.ClientSession,
    url: str,
    key: str | None,
    body: bytes,
    content_type: str,
) -> tuple[int, bool]:
    headers = {"Content-Type": content_type}
    if key is not None:
        headers["Idempotency-Key"] = key
    try:
        async with session.post(url, data=body, headers=headers) as response:
            await response.read()
            return response.status, response.headers.get("Idempotent-Replayed") == "true"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return -1 if not isinstance(exc, TimeoutError) else -2, False


async def hold_test(
    proxy_url: str,
    backend_url: str,
    admin_url: str,
    pid: int,
    key: str,
    duplicates: int,
    timeout: float = 90.0,
) -> MemoryResult:
    """`duplicates` concurrent connections send the same key to a slow backend (POST /slow).

    The first claims the job and waits in the backend until GET /_release; the others are held
    by the proxy. Once the proxy's waiters gauge shows them all held (or `timeout` passed), the
    backend is released: one execution, every other request a replay.
    """
    idle = status_kib(pid, "VmRSS")
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    client_timeout = aiohttp.ClientTimeout(total=timeout + 60)
    started = time.monotonic()
    deadline = started + timeout
    notes: list[str] = []
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session:
        posts0 = (await _get_json(session, backend_url + "/_stats"))["posts"]
        with RssSampler(pid) as sampler:
            url = proxy_url + "/slow"
            tasks = [asyncio.create_task(_post(session, url, key, BODY, "application/json"))]
            while (await _get_json(session, backend_url + "/_stats"))["slow_waiting"] < 1:
                if time.monotonic() > deadline:
                    raise RuntimeError("hold test: the first request never reached the backend")
                await asyncio.sleep(0.05)
            for batch in range(1, duplicates, 100):  # ramped: the listen backlog is finite
                for _ in range(batch, min(batch + 100, duplicates)):
                    post = _post(session, url, key, BODY, "application/json")
                    tasks.append(asyncio.create_task(post))
                await asyncio.sleep(0.02)
            held = 0
            while time.monotonic() < deadline:
                held = max(held, await _waiters(session, admin_url))
                if held >= duplicates - 1:
                    break
                await asyncio.sleep(0.1)
            if held < duplicates - 1:
                notes.append(f"only {held} of {duplicates - 1} duplicates were held at once")
            await asyncio.sleep(0.5)  # the resident set of everything held, settled
            async with session.get(backend_url + "/_release") as response:
                await response.read()
            results = await asyncio.gather(*tasks)
        posts = (await _get_json(session, backend_url + "/_stats"))["posts"] - posts0
    return MemoryResult(
        name="hold",
        title=f"{duplicates:,} held duplicates of one key (slow backend)",
        requests=len(results),
        seconds=time.monotonic() - started,
        statuses=dict(Counter(status for status, _ in results)),
        replayed=sum(1 for _, replayed in results if replayed),
        upstream_calls=posts,
        rss_idle_mb=idle / 1024,
        rss_peak_mb=sampler.peak_kib / 1024,
        hwm_mb=status_kib(pid, "VmHWM") / 1024,
        held_peak=held,
        notes=notes,
    )


async def bodies_test(
    proxy_url: str,
    backend_url: str,
    pid: int,
    key_prefix: str | None,
    count: int,
    size: int,
    timeout: float = 180.0,
) -> MemoryResult:
    """`count` concurrent requests of `size` bytes each (keyed unless key_prefix is None)."""
    idle = status_kib(pid, "VmRSS")
    body = bytes(range(256)) * (size // 256) + b"\0" * (size % 256)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    started = time.monotonic()
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session:
        posts0 = (await _get_json(session, backend_url + "/_stats"))["posts"]
        with RssSampler(pid) as sampler:
            results = await asyncio.gather(
                *(
                    _post(
                        session,
                        proxy_url + "/uploads",
                        None if key_prefix is None else f"{key_prefix}-{number}",
                        body,
                        "application/octet-stream",
                    )
                    for number in range(count)
                )
            )
        seconds = time.monotonic() - started
        posts = (await _get_json(session, backend_url + "/_stats"))["posts"] - posts0
    keyed = "with keys" if key_prefix is not None else "without keys (pass-through)"
    return MemoryResult(
        name="bodies" if key_prefix is not None else "bodies-passthrough",
        title=f"{count} concurrent {size // MIB} MiB request bodies, {keyed}",
        requests=len(results),
        seconds=seconds,
        statuses=dict(Counter(status for status, _ in results)),
        replayed=sum(1 for _, replayed in results if replayed),
        upstream_calls=posts,
        rss_idle_mb=idle / 1024,
        rss_peak_mb=sampler.peak_kib / 1024,
        hwm_mb=status_kib(pid, "VmHWM") / 1024,
    )
