from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.fidelity.apps.django_orders.settings")
application = get_wsgi_application()
