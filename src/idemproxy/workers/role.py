"""What one worker process is told by its supervisor (`server.workers` > 1).

The supervisor re-runs the same `idemproxy serve` command line for each worker and appends one
hidden flag, `--worker-role JSON`, with this. Settings are therefore built by each worker from
the same file, environment and flags as the supervisor's; only the role differs.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass, field
from typing import Any

WORKER_ROLE_FLAG = "--worker-role"
# What stops a serving process after a drain (SPEC §8), a supervisor and its workers alike.
# SIGHUP too: a closed terminal or a process manager's reload would otherwise kill the process
# with no drain (there is no configuration to reload), leaving its attempts `unknown`.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass(frozen=True, slots=True)
class WorkerRole:
    index: int
    count: int
    # Workers 1..N-1: an inherited, already listening loopback socket for their admin app,
    # bound by the supervisor (no port race, nothing on the filesystem).
    admin_fd: int | None = None
    # Worker 0 only: the other workers' admin URLs, in index order (1..N-1). Worker 0 serves
    # the configured admin address and answers /readyz and /metrics for all of them.
    peers: tuple[str, ...] = field(default_factory=tuple)

    @property
    def public_admin(self) -> bool:
        return self.admin_fd is None

    def label(self) -> str:
        return f"worker {self.index} of {self.count}"

    def to_arg(self) -> str:
        return json.dumps(
            {
                "index": self.index,
                "count": self.count,
                "admin_fd": self.admin_fd,
                "peers": list(self.peers),
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_arg(cls, text: str) -> WorkerRole:
        data: dict[str, Any] = json.loads(text)
        admin_fd = data.get("admin_fd")
        return cls(
            index=int(data["index"]),
            count=int(data["count"]),
            admin_fd=None if admin_fd is None else int(admin_fd),
            peers=tuple(str(peer) for peer in data.get("peers", ())),
        )
