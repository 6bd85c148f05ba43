"""How a route's `unknown` jobs may resolve themselves (SPEC §3.6), off unless declared.

```yaml
routes:
  - prefix: /payments
    upstream: http://payments:8080
    resolve:
      # The upstream deduplicates on the Idempotency-Key it receives, for this long.
      upstream_honours_key: {window: 24h}
      # The backend answers "did you execute it?" about an attempt.
      reconcile: {url: http://payments:8080/idempotency/reconcile, timeout: 2s}
```
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from idemproxy import constants as c
from idemproxy.config.units import Duration

_STRICT = ConfigDict(extra="forbid")


class HonoursKeySettings(BaseModel):
    """SPEC §3.6: the route's upstream deduplicates on `Idempotency-Key` for `window`, counted
    from the start of the attempt whose outcome is unknown. Within it, a retry of the job sends
    the same request under the same key again; past it, never (the upstream may have forgotten
    the key, and would execute it a second time)."""

    model_config = _STRICT
    window: Duration = Field(gt=0)


class ReconcileSettings(BaseModel):
    """SPEC §3.6: the endpoint the proxy asks whether an `unknown` attempt executed."""

    model_config = _STRICT
    url: str
    # Longest one question may take; a slower answer proves nothing.
    timeout: Duration = Field(default=c.DEFAULT_RECONCILE_TIMEOUT, gt=0)
    # The wait before the first question, doubled after every answer that proved nothing, up
    # to `max_backoff`: a backend that cannot tell yet is not asked in a loop.
    backoff: Duration = Field(default=c.DEFAULT_RECONCILE_BACKOFF, gt=0)
    max_backoff: Duration = Field(default=c.DEFAULT_RECONCILE_MAX_BACKOFF, gt=0)

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        if parts.username is not None or parts.password is not None:
            raise ValueError("must not hold a user or password (use upstream_headers)")
        return url

    @model_validator(mode="after")
    def _ordered(self) -> ReconcileSettings:
        if self.max_backoff < self.backoff:
            raise ValueError("max_backoff must be at least backoff")
        return self


class ResolveSettings(BaseModel):
    """A route's ways to resolve an `unknown` job without an operator; none by default."""

    model_config = _STRICT
    upstream_honours_key: HonoursKeySettings | None = None
    reconcile: ReconcileSettings | None = None
