"""Settings of the quotas per owner (`quotas`, SPEC §9; core/quota.py decides with them). Part
of the settings model of `config/settings.py`. Every limit is optional and off by default."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from idemproxy.config.units import ByteSize


class QuotaSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Jobs of one owner in flight at once (live leases), across every replica on the store.
    max_in_flight: int | None = Field(default=None, gt=0)
    # New jobs (new keys) of one owner per second, across every replica on the store.
    max_new_per_second: int | None = Field(default=None, gt=0)
    # Bytes of response bodies stored for one owner, each job in flight counted as
    # max_stored_body (SPEC §9); at or beyond it no new job is claimed until some expire.
    # Counting them reads the owner's jobs: see
    # docs/operations.md, Quotas, before setting it for owners with many jobs.
    max_stored_bytes: ByteSize | None = Field(default=None, gt=0)
