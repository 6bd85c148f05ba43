"""The store that seals responses before any layer keeps them (SPEC §11, encryption at rest).

`SealingStore(inner, codec)` is the outermost layer of the hot path: every completion written
through it, a winning one or an outcome written late, is sealed with the key ring's primary key
before it reaches the replay caches (Redis, in-process) and the store of record, so none of them
ever holds it in the clear. The operators reach the store of record directly: the factory
gives it the same codec (`Store.seal`, store/factory.py `wrap_with_seal`), which seals an
operator's resolution there. Jobs are read back sealed and opened only by `opened`: for a
replay, after the decision core compared the fingerprint (SPEC §2.3), and for an operator who
asks to see the response.
"""

from __future__ import annotations

from idemproxy.core.types import Job, KeptResponse, StoredResponse
from idemproxy.store.base import Store
from idemproxy.store.layers import JobLayer
from idemproxy.store.seal.codec import ResponseCodec


class SealingStore(JobLayer):
    def __init__(self, inner: Store | JobLayer, codec: ResponseCodec) -> None:
        super().__init__(inner)
        self.codec = codec

    async def complete(self, job: Job, attempt: int, response: KeptResponse, *, ttl: float) -> bool:
        sealed = self.codec.seal(job, response)
        return await self.inner.complete(job, attempt, sealed, ttl=ttl)

    def opened(self, job: Job, response: KeptResponse) -> StoredResponse:
        return self.codec.open(job, response)
