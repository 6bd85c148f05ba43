"""The paths a backend may resolve a request's path to (SPEC §10, Request targets).

The proxy forwards the target byte for byte and routes on its percent-decoded path. A backend
may resolve that path further before it routes: it removes dot segments (RFC 3986 §5.2.4), after
decoding `%2e` and `%2f`; Servlet containers (Tomcat, Jetty, Spring) strip `;params` from each
segment (RFC 3986 §3.3), so `/public/..;/payments` runs `/payments`; nginx and many frameworks
merge repeated slashes; Windows servers (IIS) take `\\` for `/` and trim trailing dots and
spaces from a segment; a C backend ends the path at a NUL. Each is one step here, and a reading
is the decoded path after any subset of them, in the order servers apply them. The proxy
refuses a path only when one of its readings falls under another route (routing.py): with one
route, or a path none of the steps changes, there is nothing to refuse.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator

# A character or sequence one of the steps below would change; a path without any (nearly
# every path) has the one reading the proxy routed by, and costs one search.
_CHANGEABLE = re.compile(r"[;\\\x00]|//|/\.|[ .](?=/|$)")
_SEGMENT_PARAMETERS = re.compile(r";[^/]*")
_REPEATED_SLASHES = re.compile(r"//+")


def _end_at_nul(path: str) -> str:
    return path.partition("\x00")[0]


def _windows(path: str) -> str:
    segments = path.replace("\\", "/").split("/")
    return "/".join(s if s.strip(".") == "" else s.rstrip(" .") for s in segments)


def _strip_parameters(path: str) -> str:
    return _SEGMENT_PARAMETERS.sub("", path)


def _merge_slashes(path: str) -> str:
    return _REPEATED_SLASHES.sub("/", path)


def remove_dot_segments(path: str) -> str:
    """RFC 3986 §5.2.4, for an absolute path."""
    output: list[str] = []
    segments = path.split("/")[1:]
    for index, segment in enumerate(segments):
        last = index == len(segments) - 1
        if segment == "..":
            if output:
                output.pop()
            if last:
                output.append("")
        elif segment == ".":
            if last:
                output.append("")
        else:
            output.append(segment)
    return "/" + "/".join(output)


Step = Callable[[str], str]
# In the order a server applies them: the string ends, separators are found, parameters are
# cut from segments, then the path is resolved.
_STEPS: tuple[Step, ...] = (
    _end_at_nul,
    _windows,
    _strip_parameters,
    _merge_slashes,
    remove_dot_segments,
)
_SUBSETS = tuple(
    subset for size in range(1, len(_STEPS) + 1) for subset in itertools.combinations(_STEPS, size)
)


def changeable(path: str) -> bool:
    """Whether any step could change `path` (a decoded path, aiohttp's `request.path`)."""
    return _CHANGEABLE.search(path) is not None


def readings(path: str) -> Iterator[str]:
    """Every other path a backend may take `path` for: each subset of the steps, in order."""
    seen = {path}
    for subset in _SUBSETS:
        reading = path
        for step in subset:
            reading = step(reading)
        if reading not in seen:
            seen.add(reading)
            yield reading
