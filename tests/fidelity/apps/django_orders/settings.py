"""Production settings, as `django-admin startproject` leaves them once deployed: DEBUG off and
one allowed host, so a request whose Host is anything else is answered 400 (DisallowedHost)."""

from __future__ import annotations

import os

SECRET_KEY = "fidelity-suite-not-a-secret"
DEBUG = False
ALLOWED_HOSTS = ["api.example.com"]
ROOT_URLCONF = "tests.fidelity.apps.django_orders.urls"
INSTALLED_APPS: list[str] = []
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
DATABASES: dict[str, dict[str, str]] = {}
USE_TZ = True
LEDGER = os.environ["LEDGER"]
# A refused Host is logged to stderr, as a container deployment collects it: the test reads
# which Host Django judged.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "loggers": {
        "django.security.DisallowedHost": {
            "handlers": ["stderr"],
            "level": "ERROR",
            "propagate": False,
        }
    },
}
