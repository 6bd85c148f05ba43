"""`idemproxy store reseal`: every stored response sealed with the primary key (SPEC §11).

Walks the completed jobs, then the late responses kept on attempts (SPEC §3.3), in bounded
batches in the store's order, resuming after the last row of each batch: a response in the
clear or under an older key of the ring is opened, sealed with the primary and written back by
a compare-and-swap on the key it was read with, so a proxy serving meanwhile, a second reseal
running at once, or a job deleted or expired under it change nothing and are only counted.
Run again, it finds nothing left to do. A response whose key is no longer in the ring is
counted as unreadable and left as it is: the operator decides (docs/operations.md). So is one in
the clear while `encryption.require_sealed` is on: no proxy wrote it then, and sealing it would
make what someone planted replayable.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from idemproxy.core.types import KeptResponse, SealedResponse
from idemproxy.errors import ResponseUnreadable
from idemproxy.store.ports import LateResponse, Resealing
from idemproxy.store.seal.codec import ResponseCodec


@dataclass(slots=True)
class ResealCounts:
    """What one walk did: `resealed` written, `changed` lost their CAS (changed or gone
    meanwhile); left as they are, by job id: `unreadable`, sealed with a key not in the ring,
    `unopenable`, whose key is in the ring but whose box does not open (altered, moved), and
    `in_the_clear`, not sealed though `require_sealed` is on."""

    resealed: int = 0
    changed: int = 0
    unreadable: list[str] = field(default_factory=list)
    unopenable: list[str] = field(default_factory=list)
    in_the_clear: list[str] = field(default_factory=list)

    def refused(self, codec: ResponseCodec, response: KeptResponse, name: str) -> None:
        """Count `response` (named `name`), which did not open, by why."""
        if not isinstance(response, SealedResponse):
            self.in_the_clear.append(name)
        elif not codec.holds(response.key_id):
            self.unreadable.append(name)
        else:
            self.unopenable.append(name)

    @property
    def left(self) -> bool:
        """Whether any response was left as it is."""
        return bool(self.unreadable or self.unopenable or self.in_the_clear)


@dataclass(frozen=True, slots=True)
class ResealReport:
    responses: ResealCounts
    late: ResealCounts
    key_id: str


async def reseal_store(
    store: Resealing, codec: ResponseCodec, *, batch_size: int, pause: float = 0.0
) -> ResealReport:
    """Reseal every response and late response not sealed with the primary key."""
    primary = codec.primary
    if primary is None:
        raise ValueError("reseal needs a key ring")
    responses = await _reseal_responses(store, codec, batch_size, pause)
    late = await _reseal_late(store, codec, batch_size, pause)
    return ResealReport(responses, late, primary)


async def _reseal_responses(
    store: Resealing, codec: ResponseCodec, batch_size: int, pause: float
) -> ResealCounts:
    counts = ResealCounts()
    jobs = await store.to_reseal(codec.primary, None, batch_size)
    while jobs:
        for job in jobs:
            assert job.response is not None, "a completed job always has a response"
            try:
                sealed = codec.reseal(job, job.response)
            except ResponseUnreadable:
                counts.refused(codec, job.response, job.id)
                continue
            if sealed is not None:
                _count(counts, await store.reseal(job, sealed))
        await asyncio.sleep(pause)  # a batch at a time: the serving proxies go first
        jobs = await store.to_reseal(codec.primary, jobs[-1], batch_size)
    return counts


async def _reseal_late(
    store: Resealing, codec: ResponseCodec, batch_size: int, pause: float
) -> ResealCounts:
    counts = ResealCounts()
    batch: list[LateResponse] = await store.late_to_reseal(codec.primary, None, batch_size)
    while batch:
        for late in batch:
            try:
                sealed = codec.reseal(late.job, late.response)
            except ResponseUnreadable:
                counts.refused(codec, late.response, f"{late.job_id} attempt {late.number}")
                continue
            if sealed is not None:
                _count(counts, await store.reseal_late(late, sealed))
        await asyncio.sleep(pause)
        batch = await store.late_to_reseal(codec.primary, batch[-1], batch_size)
    return counts


def _count(counts: ResealCounts, won: bool) -> None:
    if won:
        counts.resealed += 1
    else:
        counts.changed += 1


def report_lines(report: ResealReport) -> list[str]:
    """What `idemproxy store reseal` prints."""
    lines = [
        f"resealed {report.responses.resealed} response(s) and {report.late.resealed} late"
        f" response(s) with key {report.key_id!r}",
        f"{report.responses.changed + report.late.changed} changed meanwhile (left to the"
        " proxies; run again to be sure)",
    ]
    unreadable = report.responses.unreadable + report.late.unreadable
    if unreadable:
        lines.append(_left("unreadable (sealed with a key not in the ring)", unreadable))
    unopenable = report.responses.unopenable + report.late.unopenable
    if unopenable:
        lines.append(_left("unreadable (do not open: altered or moved)", unopenable))
    in_the_clear = report.responses.in_the_clear + report.late.in_the_clear
    if in_the_clear:
        why = "in the clear while encryption.require_sealed is on (written by no proxy: planted?)"
        lines.append(_left(why, in_the_clear))
    return lines


def _left(why: str, names: list[str]) -> str:
    shown = ", ".join(names[:20]) + (" …" if len(names) > 20 else "")
    return f"{len(names)} {why}, left as they are: {shown}"
