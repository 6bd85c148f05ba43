# idemproxy container image: docker build -t idemproxy .
#
# Configure it with IDEMPROXY_* environment variables (they beat the file) or mount a settings
# file over /etc/idemproxy/idemproxy.yaml. Jobs go to PostgreSQL in production
# (IDEMPROXY_STORE=postgresql://…); the SQLite default lives in the /data volume, so the root
# filesystem can be read-only.

# Both stages use the same base, so the virtualenv built in the first runs in the second. Pin it
# by digest for a build that does not move when the tag does:
#   docker build --build-arg BASE_IMAGE=python:3.12-slim@sha256:<digest> -t idemproxy .
ARG BASE_IMAGE=python:3.12-slim

FROM ${BASE_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
# Dependencies first, from pyproject.toml alone, at the versions constraints.txt pins (the same
# as CI's; scripts/lock refreshes them): this layer is rebuilt only when they change,
# not on every edit of the source. The `redis` extra too, so that `--redis` works in the image.
COPY pyproject.toml constraints.txt ./
RUN python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print(*p["dependencies"], *p["optional-dependencies"]["redis"], sep="\n")' \
        > requirements.txt \
    && python -m pip wheel --wheel-dir /wheels --constraint constraints.txt -r requirements.txt \
    && python -m venv /opt/idemproxy \
    && /opt/idemproxy/bin/pip install --no-index --find-links /wheels -r requirements.txt
# Then the project itself, without touching the dependencies installed above.
COPY README.md LICENSE ./
COPY src ./src
RUN /opt/idemproxy/bin/pip install --no-deps . \
    && /opt/idemproxy/bin/pip uninstall --yes pip setuptools

FROM ${BASE_IMAGE}
# idemproxy.__version__ (tests/unit/test_packaging.py keeps them equal).
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="idemproxy" \
      org.opencontainers.image.description="A reverse proxy that makes any HTTP API idempotent." \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"

# A numeric non-root user (Kubernetes' runAsNonRoot can only verify a number). The image's own
# settings file only moves the listener off loopback and the SQLite default into /data.
RUN groupadd --gid 10001 idemproxy \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /data \
        --shell /usr/sbin/nologin idemproxy \
    && mkdir -p /data /etc/idemproxy \
    && printf '%s\n' \
        '# Image defaults; IDEMPROXY_* variables override them. Replace this file to configure.' \
        'listen: 0.0.0.0:8080' \
        'store: sqlite:////data/idemproxy.db' \
        > /etc/idemproxy/idemproxy.yaml \
    && chown 10001:10001 /data

COPY --from=build /opt/idemproxy /opt/idemproxy
ENV PATH=/opt/idemproxy/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    IDEMPROXY_CONFIG=/etc/idemproxy/idemproxy.yaml
WORKDIR /data
VOLUME ["/data"]
USER 10001:10001
# 8080: the proxy; 9090: the admin listener (/healthz, /readyz, /metrics), loopback by default.
EXPOSE 8080 9090

# No curl in slim images. The admin port follows IDEMPROXY_ADMIN__LISTEN when it is set.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('IDEMPROXY_ADMIN__LISTEN', ':9090').rpartition(':')[2]; urllib.request.urlopen(f'http://127.0.0.1:{port}/healthz', timeout=4)"]

ENTRYPOINT ["idemproxy"]
CMD ["serve"]
