"""Pure: token-bucket arithmetic on an injected clock, and reading rate-limit headers."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from idemproxy.batch.admission import LimiterGate
from idemproxy.batch.client import Answer
from idemproxy.batch.constants import RETRY_AFTER_CAP_SECONDS
from idemproxy.batch.ratelimit import (
    DEFAULT_PAUSE_SECONDS,
    RateLimiter,
    TokenBucket,
    parse_duration,
    pause_seconds,
)
from idemproxy.batch.stop import Stop
from idemproxy.batch.usage import BUILT_IN_POINTERS


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_holds_a_second_and_refills_at_the_rate() -> None:
    bucket = TokenBucket(per_minute=120, now=0.0)  # 2 a second
    assert bucket.capacity == 2 and bucket.wait(2, 0.0) == 0
    bucket.take(2, 0.0)
    assert bucket.wait(1, 0.0) == pytest.approx(0.5)
    assert bucket.wait(1, 0.5) == 0
    bucket.refill(100.0)
    assert bucket.level == 2  # idle time saves at most the capacity


def test_a_slow_limit_still_lets_one_request_through() -> None:
    bucket = TokenBucket(per_minute=6, now=0.0)  # one every 10 s
    assert bucket.capacity == 1 and bucket.wait(1, 0.0) == 0
    bucket.take(1, 0.0)
    assert bucket.wait(1, 0.0) == pytest.approx(10.0)


def test_an_item_larger_than_the_bucket_waits_for_it_full_and_leaves_a_debt() -> None:
    bucket = TokenBucket(per_minute=60_000, now=0.0)  # 1,000 a second
    bucket.take(1000, 0.0)
    assert bucket.wait(5000, 0.0) == pytest.approx(1.0)  # waits for a full bucket, not 5 s
    bucket.take(5000, 1.0)
    assert bucket.level == pytest.approx(-4000)
    assert bucket.wait(1, 1.0) == pytest.approx(4.001)  # the debt is paid off at the rate


def test_a_correction_gives_back_or_takes_more() -> None:
    bucket = TokenBucket(per_minute=60_000, now=0.0)
    bucket.take(900, 0.0)  # estimated
    bucket.give_back(900 - 40, 0.0)  # used 40
    assert bucket.level == pytest.approx(960)
    bucket.give_back(10_000, 0.0)
    assert bucket.level == 1000  # never more than it holds
    bucket.give_back(-3000, 0.0)  # used far more than estimated
    assert bucket.level == pytest.approx(-2000)


def test_a_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="> 0"):
        TokenBucket(per_minute=0, now=0.0)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("6m0s", 360.0),
        ("1s", 1.0),
        ("20ms", 0.02),
        ("1h2m3.5s", 3723.5),
        ("0.5s", 0.5),
        ("250us", 0.00025),
        ("2", 2.0),
        ("1.5", 1.5),
        ("", None),
        ("soon", None),
        ("5x", None),
        ("1s junk", None),
        ("-1", None),
        ("nan", None),
    ],
)
def test_durations(text: str, seconds: float | None) -> None:
    assert parse_duration(text) == (pytest.approx(seconds) if seconds is not None else None)


def test_retry_after_in_seconds_or_as_a_date_wins() -> None:
    assert pause_seconds({"Retry-After": "3", "x-ratelimit-reset-requests": "1m"}) == 3.0
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    assert pause_seconds({"retry-after": when}) == pytest.approx(30, abs=1.5)
    assert pause_seconds({"retry-after-ms": "1500", "Retry-After": "2"}) == 1.5
    assert pause_seconds({"Retry-After": "99999"}) == RETRY_AFTER_CAP_SECONDS


def test_the_reset_of_the_limit_that_ran_out() -> None:
    tokens_out = {
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "6m0s",
    }
    assert pause_seconds(tokens_out) == 300.0  # 6 minutes, capped
    requests_out = {
        **tokens_out,
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-remaining-tokens": "100",
        "x-ratelimit-reset-tokens": "20ms",
    }
    assert pause_seconds(requests_out) == 1.0
    neither = {**requests_out, "x-ratelimit-remaining-requests": "3"}
    assert pause_seconds(neither) == pytest.approx(0.02)  # the soonest
    assert pause_seconds({"X-RateLimit-Reset-Requests": "250ms"}) == pytest.approx(0.25)
    assert pause_seconds({}) is None and pause_seconds({"Retry-After": "later"}) is None


def test_the_limiter_on_an_injected_clock() -> None:
    clock = Clock()
    limiter = RateLimiter(rpm=60, tpm=6000, clock=clock)  # 1 request, 100 tokens a second
    assert limiter.delay(100) == 0
    limiter.requests.take(1, clock.now)  # type: ignore[union-attr]
    limiter.tokens.take(100, clock.now)  # type: ignore[union-attr]
    assert limiter.delay(50) == pytest.approx(1.0)  # the request bucket is the later one
    clock.now += 1.0
    assert limiter.delay(50) == 0
    limiter.correct(estimated=100, used=10)  # the answer used less: 90 come back
    assert limiter.delay(100) == 0
    assert limiter.pause(5.0) == 5.0 and limiter.delay(1) == pytest.approx(5.0)
    assert limiter.pause(None) == DEFAULT_PAUSE_SECONDS and limiter.delay(1) == pytest.approx(5.0)
    clock.now += 5.0
    assert limiter.delay(1) == 0 and limiter.pauses == 2


def test_without_limits_only_a_pause_holds() -> None:
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    assert limiter.delay(10**9) == 0
    limiter.pause(2.0)
    assert limiter.delay(0) == pytest.approx(2.0)


async def test_waiters_share_the_bucket_in_turn_and_a_stop_ends_a_wait() -> None:
    limiter = RateLimiter(rpm=600)  # 10 a second, a bucket of 10
    started = time.monotonic()
    results = await asyncio.gather(*(limiter.acquire(1) for _ in range(15)))
    assert all(results)
    assert 0.4 < time.monotonic() - started < 2.0  # 10 at once, 5 more at 10 a second
    limiter.pause(60.0)
    stop = asyncio.Event()
    waiting = asyncio.ensure_future(limiter.acquire(1, stop))
    await asyncio.sleep(0.05)
    stop.set()
    assert await asyncio.wait_for(waiting, 1.0) is False


async def test_after_a_pause_one_request_goes_first_and_the_rest_follow_its_answer() -> None:
    limiter = RateLimiter()
    limiter.pause(0.05)
    first = asyncio.ensure_future(limiter.acquire(1))
    second = asyncio.ensure_future(limiter.acquire(1))
    assert await asyncio.wait_for(first, 1.0)
    await asyncio.sleep(0.05)
    assert not second.done()  # waits for an answer to the first
    limiter.answered()
    assert await asyncio.wait_for(second, 1.0)
    third = await asyncio.wait_for(limiter.acquire(1), 1.0)  # no pause since: no waiting
    assert third


def _answer(*, replayed: bool, used: int) -> Answer:
    body = json.dumps({"usage": {"prompt_tokens": used, "completion_tokens": 0}}).encode()
    return Answer(200, None, replayed, False, None, "application/json", body)


@pytest.mark.parametrize("sent_before", [False, True])
async def test_a_late_answer_to_this_batchs_own_try_keeps_the_tokens_it_used(
    sent_before: bool,
) -> None:
    # SPEC §14: a try sent without an answer (here, or in the run that wrote the item's line)
    # started an execution; the replay that answers it says what that execution used, which
    # was spent under the limit: kept, once. Before, such a replay gave its tokens back.
    limiter = RateLimiter(tpm=60_000, clock=Clock())  # a bucket of 1,000 tokens
    assert limiter.tokens is not None
    gate = LimiterGate(limiter, 300, Stop(), BUILT_IN_POINTERS, sent_before=sent_before)
    if not sent_before:
        assert await limiter.acquire(300)
        gate.after(None)  # the runner's --timeout: no answer, the estimate stands
        assert limiter.tokens.level == 700
    assert await limiter.acquire(300)
    gate.after(_answer(replayed=True, used=120))
    assert limiter.tokens.level == 1000 - 120
    # A replay of an execution this batch did not start used nothing now.
    free = LimiterGate(limiter, 300, Stop(), BUILT_IN_POINTERS)
    assert await limiter.acquire(300)
    free.after(_answer(replayed=True, used=120))
    assert limiter.tokens.level == 1000 - 120
