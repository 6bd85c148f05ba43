"""The owner policy of a process, with an identity provider's keys when configured (SPEC §5)."""

from __future__ import annotations

import logging

from idemproxy.config.settings import OwnerSettings
from idemproxy.errors import ConfigError
from idemproxy.identity.intent import OwnerPolicy, owner_policy
from idemproxy.proxy.idp.fetch import JwksClient
from idemproxy.proxy.idp.keys import RemoteKeys
from idemproxy.proxy.upstream.tls import tls_context
from idemproxy.redact import redact_url

log = logging.getLogger(__name__)


def build_owner_policy(settings: OwnerSettings) -> OwnerPolicy:
    """Built once at start-up, before the event loop: local keys are read now, an identity
    provider's are fetched when the policy starts (`OwnerPolicy.start`); `ConfigError` naming
    the field at fault."""
    jwt = settings.jwt
    if settings.strategy != "jwt" or not jwt.remote:
        return owner_policy(settings)
    try:
        tls = tls_context(jwt.idp.tls)
    except ValueError as exc:
        raise ConfigError(f"owner.jwt.idp.tls.{exc}") from exc
    if not jwt.idp.tls.verify:
        # As an upstream's (proxy/upstream/dial.py): said once at start, never in silence.
        log.warning(
            "owner.jwt.idp %s: TLS certificates are not verified (its tls.verify is false):"
            " anyone on the path can serve the keys that decide every owner",
            redact_url(jwt.jwks_uri or jwt.issuer or ""),
        )
    return owner_policy(settings, keys=RemoteKeys(JwksClient(jwt, tls), jwt.idp))
