"""A job's attempts across its upstream group as a pure machine (SPEC §3.4).

The race's rules: `none_executed`, `may_hedge` and `brings_in_next` say when another upstream
may come in; `race_outcome`, `race_end` and `settling_index` what a race of hedged attempts
ends in, and which failure settles its job.

In order: `Try` the upstream at `index`; a failure it hands back (released: nothing executed)
`FailOver`s to the next one, the last runs in `Mode.FINAL` and never hands back.

Hedged: the `Race` is plain data (how many upstreams came in, how many racers still run, the
outcomes of those that failed, store errors, a lost CAS); `Wait` waits for the racers, at most
hedge_after while another upstream may come in; `AddHedge` brings it in. A race without a winner
ends `RaceLost`, `RaceStoreError` or `SettleRace`. The driver (proxy/jobs/jobrun.py) owns the
tasks, the timer and the responses; no I/O, no clock, no asyncio here.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import assert_never

from idemproxy.core.frozen import frozen
from idemproxy.core.machine import Mode, Outcome, moves_on, order_mode

# --- the race's rules -----------------------------------------------------------------------------


class RaceEnd(enum.Enum):
    """How a race of hedged attempts ended when none of them answered this client (SPEC §3.4)."""

    LOST = "lost"  # an attempt lost the completion CAS: another one completed the job
    STORE_ERROR = "store-error"  # a racer's outcome was not written: the race cannot settle
    ALL_FAILED = "all-failed"  # every racer failed: the race settles the job


def race_outcome(outcomes: Iterable[Outcome]) -> Outcome:
    """The job's outcome when every attempt of a race failed (SPEC §3.4): unknown if any of
    them may have executed, else released."""
    return Outcome.RELEASE if all(moves_on(o) for o in outcomes) else Outcome.UNKNOWN


def none_executed(failures: Iterable[Outcome], *, store_errors: bool) -> bool:
    """SPEC §3.4: whether no racer so far may have executed. A racer that ended with a store
    error (its outcome not written, or its answer not stored) is one whose outcome the race does
    not know: it may have executed."""
    return not store_errors and race_outcome(failures) is Outcome.RELEASE


def may_hedge(*, started: int, upstreams: int, lost: bool, none_executed: bool) -> bool:
    """Whether the race may still bring in another upstream (SPEC §3.4): one is left, no racer
    lost the completion CAS (another attempt completed the job), and none may have executed."""
    return started < upstreams and not lost and none_executed


def brings_in_next(*, admitted: bool, none_executed: bool, timed_out: bool, racing: bool) -> bool:
    """After one wait of the race: whether the next upstream comes in now. It must have been
    admitted before the wait (`may_hedge`) and still be (no racer that ended meanwhile may have
    executed), and either no answer came within hedge_after (`timed_out`) or every racer failed
    (none is `racing` any more)."""
    return admitted and none_executed and (timed_out or not racing)


def race_end(*, lost: bool, store_errors: bool) -> RaceEnd:
    """What a race without a winner for this client ends in: another attempt's completion
    first (its response is the job's), then a store error (SPEC §11: 503), else every racer
    failed."""
    if lost:
        return RaceEnd.LOST
    if store_errors:
        return RaceEnd.STORE_ERROR
    return RaceEnd.ALL_FAILED


def settling_index(outcomes: Sequence[Outcome]) -> int:
    """Which of a race's failures, in the order they ended, settles the job and answers the
    client (SPEC §3.4): the last unknown one if any racer may have executed, else the last."""
    if not outcomes:
        raise ValueError("a race that ended without a winner had failures")
    for index in range(len(outcomes) - 1, -1, -1):
        if outcomes[index] is Outcome.UNKNOWN:
            return index
    return len(outcomes) - 1


# --- in order -----------------------------------------------------------------------------------


@frozen
class Try:
    """Command: run an attempt on the `index`-th of `upstreams`; its response or a lost CAS
    ends the job's run, a hand-back is the event."""

    index: int
    upstreams: int

    @property
    def mode(self) -> Mode:
        return order_mode(self.index, self.upstreams)

    def next(self) -> FailOver:
        """The attempt handed its failure back: it proved nothing executed (SPEC §3.4)."""
        if self.index + 1 >= self.upstreams:
            raise ValueError("the last upstream runs in FINAL mode and never hands back")
        return FailOver(self.index + 1, self.upstreams)


@frozen
class FailOver:
    """Command: record the failed attempt and start the next one, on the `index`-th upstream;
    the event is whether the store started it (not when another attempt completed the job)."""

    index: int
    upstreams: int

    def next(self, started: bool) -> Try | RaceLost:
        return Try(self.index, self.upstreams) if started else RaceLost()


# --- hedged -------------------------------------------------------------------------------------


class RacerEnd(enum.Enum):
    """How one racer ended, when it did not answer the client."""

    RELEASED = "released"  # failed, and proved that nothing executed
    UNKNOWN = "unknown"  # failed, and may have executed
    LOST = "lost"  # another attempt won the completion CAS
    STORE_ERROR = "store-error"  # its outcome was not written (kept to write later)


_FAILED = {RacerEnd.RELEASED: Outcome.RELEASE, RacerEnd.UNKNOWN: Outcome.UNKNOWN}


def racer_end(outcome: Outcome) -> RacerEnd:
    """A failed racer's end, by its outcome."""
    return RacerEnd.RELEASED if outcome is Outcome.RELEASE else RacerEnd.UNKNOWN


@frozen
class Race:
    """The bookkeeping of one hedged request (SPEC §3.4)."""

    upstreams: int
    started: int = 1  # upstreams brought in (or given up on)
    racing: int = 1  # racers still running
    failures: tuple[Outcome, ...] = ()  # of the racers that failed, in the order they ended
    store_errors: int = 0
    lost: bool = False  # a racer lost the completion CAS: another attempt completed the job

    def none_executed(self) -> bool:
        """SPEC §3.4: once any racer may have executed, no further upstream comes in, neither
        as a fail-over (every racer failed) nor by the hedge timer."""
        return none_executed(self.failures, store_errors=self.store_errors > 0)

    def may_hedge(self) -> bool:
        return may_hedge(
            started=self.started,
            upstreams=self.upstreams,
            lost=self.lost,
            none_executed=self.none_executed(),
        )

    def ended(self, ends: tuple[RacerEnd, ...]) -> Race:
        failures, store_errors, lost = self.failures, self.store_errors, self.lost
        for end in ends:
            match end:
                case RacerEnd.RELEASED | RacerEnd.UNKNOWN:
                    failures += (_FAILED[end],)
                case RacerEnd.STORE_ERROR:
                    store_errors += 1
                case RacerEnd.LOST:
                    # The CAS winner may be a racer of this very request, still streaming its
                    # body to this client: a replay now would be a second response in the
                    # middle of that body (SPEC §7, one response per request). Wait for it.
                    lost = True
                case _:
                    assert_never(end)
        return replace(
            self,
            racing=self.racing - len(ends),
            failures=failures,
            store_errors=store_errors,
            lost=lost,
        )

    def go_on(self) -> RaceState:
        """Wait again while a racer runs, else end the race."""
        if self.racing:
            return Wait(self, admitted=self.may_hedge())
        end = race_end(lost=self.lost, store_errors=self.store_errors > 0)
        match end:
            case RaceEnd.LOST:
                return RaceLost()  # the winner was another request's attempt: re-read the job
            case RaceEnd.STORE_ERROR:
                return RaceStoreError()
            case RaceEnd.ALL_FAILED:
                return SettleRace(settling_index(self.failures))
            case _:
                assert_never(end)


@frozen
class Wait:
    """Command: wait for the racers, at most hedge_after if another upstream is `admitted`
    (checked before the wait); the event is how those that ended did, none if the timer fired.
    A racer's answer ends the race (the driver returns it) before this is asked."""

    race: Race
    admitted: bool

    def next(self, ends: tuple[RacerEnd, ...]) -> RaceState:
        race = self.race.ended(ends)
        if brings_in_next(
            admitted=self.admitted,
            none_executed=race.none_executed(),
            timed_out=not ends,
            racing=race.racing > 0,
        ):
            return AddHedge(race)
        return race.go_on()


@frozen
class AddHedge:
    """Command: one more attempt on upstream number `race.started` (counting from 0); the event
    is whether the job took it (not once it completed), or None for a store error."""

    race: Race

    def next(self, started: bool | None) -> RaceState:
        race = self.race
        if started is None:
            if not race.racing:
                return RaceStoreError()  # nobody answers this client: the store's 503
            # A racer may be streaming its answer to this client: no 503 in its middle, and no
            # further upstream.
            race = replace(race, store_errors=race.store_errors + 1, started=race.upstreams)
        race = replace(race, started=race.started + 1, racing=race.racing + bool(started))
        return race.go_on()


@frozen
class RaceLost:
    """Another attempt completed the job: the caller re-reads it."""


@frozen
class RaceStoreError:
    """A racer's outcome, or the next attempt, could not be written: the store's 503 (SPEC §11)."""


@frozen
class SettleRace:
    """Command: every racer failed; settle the job with the `index`-th failure, in the order
    they ended, and answer with it (SPEC §3.4)."""

    index: int


RaceState = Wait | AddHedge | RaceLost | RaceStoreError | SettleRace
