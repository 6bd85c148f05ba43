"""nginx as a plain reverse proxy in front of the backend: the floor for one proxy hop."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import nginx
from common import Service, free_port, running
from model import Scenario
from runner import Bench, Step

NGINX = Scenario("nginx", "nginx reverse proxy (POST)", "nginx", "post.lua")


def run(bench: Bench) -> None:
    prefix = Path(tempfile.mkdtemp(prefix="bench-nginx-"))
    prefix.chmod(0o755)
    try:
        port = free_port()
        conf = nginx.write_config(prefix, port, bench.services["backend"].port)
        argv = nginx.argv(bench.tools["nginx"], prefix, conf)
        service = Service("nginx", argv, port, bench.run_dir)
        bench.services["nginx"] = service
        with running(service):
            bench.measure(NGINX)
        with contextlib.suppress(OSError):
            (bench.run_dir / "nginx.conf").write_text(conf.read_text())
            (bench.run_dir / "nginx-error.log").write_text((prefix / "error.log").read_text())
    finally:
        for path in sorted(prefix.rglob("*"), reverse=True):
            with contextlib.suppress(OSError):
                path.rmdir() if path.is_dir() else path.unlink()
        with contextlib.suppress(OSError):
            prefix.rmdir()


STEP = Step("nginx", (NGINX,), run)
