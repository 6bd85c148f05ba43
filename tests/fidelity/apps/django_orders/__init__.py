"""A Django project: DEBUG off, `ALLOWED_HOSTS = ["api.example.com"]`, served by gunicorn."""
