"""The tools the benchmark needs besides the project: Debian packages and its own virtualenv.

Nothing is skipped for want of a tool: a missing one is installed when we can (apt-get as root;
pip into the benchmark's own virtualenv) and otherwise the run stops with what to install.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "bench" / "requirements-bench.txt"
BENCH_VENV = ROOT / "build" / "bench-peer-venv"  # git-ignored; never the project's .venv

# executable -> the Debian package that ships it
DEBIAN_PACKAGES = {
    "wrk": "wrk",
    "nginx": "nginx-light",
    "pgbench": "postgresql-client",
    "redis-server": "redis-server",
}
_SBIN = ("/usr/sbin", "/sbin")


def which(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for folder in _SBIN:  # nginx lives in /usr/sbin, not always on a user's PATH
        candidate = Path(folder) / name
        if candidate.exists() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def ensure_debian_tools(names: list[str]) -> dict[str, str]:
    """`{name: path}` of every tool, installing the missing ones with apt-get when root."""
    missing = [name for name in names if which(name) is None]
    if missing:
        packages = sorted({DEBIAN_PACKAGES[name] for name in missing})
        if os.geteuid() != 0:
            sys.exit(
                f"bench: missing {', '.join(missing)}; install them with "
                f"`sudo apt-get install -y {' '.join(packages)}` (or run bench/run as root)."
            )
        print(f"bench: installing {' '.join(packages)} (apt-get)…", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for command in (
            ["apt-get", "update", "-qq"],
            ["apt-get", "install", "-y", "-qq", *packages],
        ):
            subprocess.run(command, check=True, env=env, timeout=900, stdout=subprocess.DEVNULL)
    found: dict[str, str] = {}
    for name in names:
        path = which(name)
        if path is None:
            sys.exit(f"bench: {name} is still missing after apt-get install.")
        found[name] = path
    return found


def bench_python() -> Path:
    """The benchmark venv's Python, created or brought up to bench/requirements-bench.txt."""
    python = BENCH_VENV / "bin" / "python"
    stamp = BENCH_VENV / ".requirements-sha256"
    wanted = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    if python.exists() and stamp.exists() and stamp.read_text().strip() == wanted:
        return python
    print(f"bench: preparing {BENCH_VENV} (pip install)…", flush=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(BENCH_VENV)], check=True, timeout=300)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "-r", str(REQUIREMENTS)],
        check=True,
        timeout=900,
    )
    stamp.write_text(wanted + "\n")
    return python


def bench_tool(name: str) -> str:
    """An executable of the benchmark venv (py-spy)."""
    path = BENCH_VENV / "bin" / name
    if not path.exists():
        sys.exit(f"bench: {path} is missing; delete {BENCH_VENV} and rerun to recreate it.")
    return str(path)


def version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except OSError:
        return "unknown"
    text = (out.stdout or out.stderr).strip().splitlines()
    return text[0] if text else "unknown"
