"""How the store of record tells the layers in front of its hot path (store/layers.py) of the
changes made past them, and seals what the operators write (SPEC §11)."""

from __future__ import annotations

import abc
import enum
from typing import Protocol

from idemproxy.core.types import Job, KeptResponse, StoredResponse


class Change(enum.Enum):
    """A change of a job made past the hot path, which a replay cache in front must learn of."""

    RESOLVED = "resolved"  # an operator's (or unknown_ttl's) resolution (SPEC §3.3)
    DELETED = "deleted"  # an operator's deletion or an erasure's (SPEC §3.3, §11)
    RESEALED = "resealed"  # `idemproxy store reseal` replaced the box (SPEC §11)
    # A cache's copy of the job's response did not open (SPEC §11: a Redis entry changed by
    # someone with write access to it): every cache drops it; the store of record is asked.
    UNREADABLE = "unreadable"


class ChangeHook(Protocol):
    """How a replay cache in front of the hot path keeps its guarantees (SPEC §11) when a
    job changes through the store of record directly: registered on it (`Store.hooks`)."""

    @abc.abstractmethod
    async def deleting(self, job: Job) -> None:
        """Before the job is deleted: stop replaying it from here on."""

    @abc.abstractmethod
    def changed(self, job: Job, change: Change, won: bool) -> None:
        """After the change's statement: `won`, whether it changed the job (False also when
        the statement failed)."""


class ResponseSeal(Protocol):
    """The key ring's codec (store/seal/codec.py), as the store of record uses it."""

    def seal(self, job: Job, response: KeptResponse) -> KeptResponse: ...

    def open(self, job: Job, response: KeptResponse) -> StoredResponse: ...
