"""The TLS contexts of the upstream leg: one per distinct setting, built once (SPEC §10)."""

from __future__ import annotations

import functools
import ssl
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the settings validate themselves by building their context
    from idemproxy.config.upstream import UpstreamTlsSettings


@functools.cache
def tls_context(settings: UpstreamTlsSettings) -> ssl.SSLContext:
    """The context for `settings`; `ValueError` naming the field when a file is unusable.

    Cached by the settings' value: upstreams with the same settings share one context, and so
    its session cache, and validating the settings at start-up already built it.
    """
    try:
        context = ssl.create_default_context(
            cafile=None if settings.ca_file is None else str(settings.ca_file)
        )
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"ca_file: no PEM CA certificate in {settings.ca_file} ({exc})") from exc
    if settings.cert_file is not None:
        try:
            context.load_cert_chain(
                settings.cert_file, None if settings.key_file is None else settings.key_file
            )
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(
                f"cert_file, key_file: not a PEM certificate and its matching key ({exc})"
            ) from exc
    if not settings.verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
