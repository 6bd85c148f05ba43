"""idemproxy: a reverse proxy that makes any HTTP API idempotent (see SPEC §1)."""

from __future__ import annotations

__version__ = "0.1.0"
