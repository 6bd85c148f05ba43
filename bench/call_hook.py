"""Runs `idemproxy` (its own `main`) with a profile hook that records the proxy's own calls
while told to: the process side of bench/calls.py.

    python bench/call_hook.py CONTROL_SOCKET serve --listen … --upstream … --store …

A thread listens on the Unix socket CONTROL_SOCKET for one connection at a time and reads lines:
`start` starts recording (answered `started`), `stop` stops it and answers with one JSON line,
the calls recorded in between, in order: `[callee file, callee qualified name, caller file or
null]` each. Only calls of functions defined under the `idemproxy` package's directory are
recorded, in every thread, each frame once: the profile hook's "call" event also comes each
time a generator or coroutine resumes (at `await`, `yield`) or is closed, and those are not new
calls.
"""

from __future__ import annotations

import json
import opcode
import os
import socket
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import idemproxy
from idemproxy.cli.main import main as idemproxy_main

PACKAGE = str(Path(idemproxy.__file__).resolve().parent) + os.sep
_RESUME = opcode.opmap["RESUME"]

Call = tuple[str, str, str | None]


class Recorder:
    """The profile hook and what it recorded; `start` and `stop` may come from another thread
    (the GIL orders them with the hook's appends)."""

    def __init__(self, package: str = PACKAGE) -> None:
        self.package = package
        self.recording = False
        self.calls: list[Call] = []

    def start(self) -> None:
        self.calls = []
        self.recording = True

    def stop(self) -> list[Call]:
        self.recording = False
        calls, self.calls = self.calls, []
        return calls

    def hook(self, frame: FrameType, event: str, _arg: Any) -> None:
        if not self.recording or event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(self.package):
            return
        # A frame starts at its RESUME with oparg 0. A generator or coroutine resumed after a
        # yield or an await enters at a RESUME with oparg 1 to 3 (the low two bits), and one
        # closed or thrown into while suspended (`all()` stopping early) at its YIELD_VALUE.
        at = frame.f_lasti
        if at < 0 or code.co_code[at] != _RESUME or code.co_code[at + 1] & 3:
            return
        caller = frame.f_back
        self.calls.append(
            (code.co_filename, code.co_qualname, caller.f_code.co_filename if caller else None)
        )


def _serve_control(path: str, recorder: Recorder) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(1)
        while True:
            conn, _ = server.accept()
            with conn, conn.makefile("rw", encoding="utf-8") as stream:
                for line in stream:
                    command = line.strip()
                    if command == "start":
                        recorder.start()
                        stream.write("started\n")
                    elif command == "stop":
                        stream.write(json.dumps(recorder.stop()) + "\n")
                    else:
                        stream.write(f"unknown command {command!r}\n")
                    stream.flush()


def main(argv: list[str]) -> int:
    control, *idemproxy_argv = argv
    recorder = Recorder()
    thread = threading.Thread(
        target=_serve_control, args=(control, recorder), name="call-hook", daemon=True
    )
    thread.start()
    # The loop's thread (this one) and every thread the proxy starts (the log writer, SQLite's).
    threading.setprofile(recorder.hook)
    sys.setprofile(recorder.hook)
    return idemproxy_main(idemproxy_argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
