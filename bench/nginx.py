"""nginx as a plain reverse proxy in front of the backend: the floor for one proxy hop.

Debian's nginx (nginx-light), run in the foreground (`daemon off`) with a configuration of its
own in a temporary folder: `worker_processes 1` (one worker, like idemproxy's one process; the
master only supervises), no access log, HTTP/1.1 with a keep-alive pool to the upstream
(`keepalive 64`, `proxy_set_header Connection ""`), and the X-Forwarded-* headers idemproxy adds.
"""

from __future__ import annotations

from pathlib import Path

WORKER_PROCESSES = 1
UPSTREAM_KEEPALIVE = 64


def write_config(prefix: Path, listen_port: int, upstream_port: int) -> Path:
    """Writes `nginx.conf` (and the folders it names) under `prefix`; returns its path."""
    for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (prefix / name).mkdir(parents=True, exist_ok=True)
        (prefix / name).chmod(0o777)  # the worker may run as nobody when we are root
    conf = prefix / "nginx.conf"
    conf.write_text(
        f"""worker_processes {WORKER_PROCESSES};
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    upstream backend {{
        server 127.0.0.1:{upstream_port};
        keepalive {UPSTREAM_KEEPALIVE};
    }}
    server {{
        listen 127.0.0.1:{listen_port};
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto $scheme;
            proxy_set_header X-Forwarded-Host $host;
        }}
    }}
}}
"""
    )
    return conf


def argv(binary: str, prefix: Path, conf: Path) -> list[str]:
    return [binary, "-p", str(prefix), "-c", str(conf), "-g", "daemon off;"]


def describe() -> str:
    return (
        f"`worker_processes {WORKER_PROCESSES}`, no access log, HTTP/1.1 keep-alive to the "
        f"upstream (`keepalive {UPSTREAM_KEEPALIVE}`)"
    )
