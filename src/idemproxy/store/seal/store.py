"""The store that seals responses before any layer keeps them (SPEC §11, encryption at rest).

`SealingStore(inner, codec)` is the outermost store: every response written through it, a
winning completion, an outcome written late, an operator's resolution, is sealed with the key
ring's primary key before it reaches the replay caches (Redis, in-process) and the store of
record, so none of them ever holds it in the clear. Jobs are read back sealed and opened only
by `opened`: for a replay, after the decision core compared the fingerprint (SPEC §2.3), and
for an operator who asks to see the response.
"""

from __future__ import annotations

from idemproxy.core.types import Job, JobState, KeptResponse, StoredResponse
from idemproxy.store.base import Store
from idemproxy.store.cache.delegating import DelegatingStore
from idemproxy.store.seal.codec import ResponseCodec


class SealingStore(DelegatingStore):
    def __init__(self, inner: Store, codec: ResponseCodec) -> None:
        super().__init__(inner)
        self.codec = codec

    async def complete(self, job: Job, attempt: int, response: KeptResponse, *, ttl: float) -> bool:
        sealed = self.codec.seal(job, response)
        return await self.inner.complete(job, attempt, sealed, ttl=ttl)

    async def resolve(
        self,
        job: Job,
        state: JobState,
        *,
        response: KeptResponse | None = None,
        ttl: float = 0.0,
        resolution: str = "operator",
    ) -> bool:
        if response is not None:
            response = self.codec.seal(job, response)
        return await self.inner.resolve(
            job, state, response=response, ttl=ttl, resolution=resolution
        )

    def opened(self, job: Job, response: KeptResponse) -> StoredResponse:
        return self.codec.open(job, response)
