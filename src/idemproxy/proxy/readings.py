"""The paths a backend may resolve a request's path to (SPEC §10, Request targets).

The proxy forwards the target byte for byte and routes on its percent-decoded path. A backend
may resolve that path further before it routes: it removes dot segments (RFC 3986 §5.2.4), after
decoding `%2e` and `%2f`; Servlet containers (Tomcat, Jetty, Spring) strip `;params` from each
segment (RFC 3986 §3.3), so `/public/..;/payments` runs `/payments`; nginx and many frameworks
merge repeated slashes; Windows servers (IIS) take `\\` for `/` and trim trailing dots and
spaces from a segment; Spring's AntPathMatcher trims whitespace from each segment and Python's
`re` lets `^/payments$` match `/payments\\n`; a C backend ends the path at a NUL. Each is one
step here, and a reading is the decoded path after any subset of them, in the order servers
apply them.

A WHATWG URL parser (Node's `new URL(req.url)`) removes dot segments from the raw path, where
`a%2Fb` is one segment and `%2e` is a dot: `/a%2Fb/../payments` is `/payments` there, and
`/a/payments` once decoded. So the steps also run on the path with its encoded separators kept
opaque (`opaque`), and each result is then decoded.

A path that starts with two separators is a network-path reference (RFC 3986 §4.2) to a parser
given it alone: Python's `urlsplit`, PHP's `parse_url`, Java's `URI`, Go's `url.Parse` take
`//evil/payments` as the authority `evil` and the path `/payments`; a WHATWG parser does so
with any run of `/` and `\\` (`///evil/payments`, `/\\evil/payments`), its host ending at `/`,
`\\`, `?` or `#`. So a path is also read with that authority dropped (`without_authority`),
before the steps.

The proxy refuses a path only when one of its readings falls under another route (routing.py):
with one route, or a path none of the steps changes, there is nothing to refuse.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from urllib.parse import unquote

# A character or sequence one of the steps below would change; a path without any (nearly
# every path) has the one reading the proxy routed by, and costs one search. The path kept
# opaque (`opaque`) holds a subset of the decoded path's: it has no trigger the decoded lacks.
_CHANGEABLE = re.compile(r"[;\\\x00-\x1f\x7f]|//|/[. ]|[ .](?=/|$)")
_SEGMENT_PARAMETERS = re.compile(r";[^/]*")
_REPEATED_SLASHES = re.compile(r"//+")
# Whitespace and control characters (0x00-0x20, 0x7F), as Java's String.trim() takes them.
_BLANK = "".join(map(chr, range(0x21))) + "\x7f"
# Stand-ins for `%2F` and `%5C` while they are not separators: lone surrogates, which decoding
# (UTF-8, errors replaced) never yields.
_SLASH, _BACKSLASH = "\udc2f", "\udc5c"
_ENCODED_SEPARATOR = re.compile(r"%(?:2[fF]|5[cC])")
# RFC 3986 §4.2, a network-path reference: two separators (WHATWG takes `\\` for `/`), then the
# authority, which ends at `/`, `?` or `#` (RFC 3986 §3.2), or also `\\` (WHATWG host state).
_AUTHORITY = re.compile(r"[/\\]{2}")
_RFC_AUTHORITY = re.compile(r"[^/?#]*")
_WHATWG_HOST = re.compile(r"[^/\\?#]*")


def _end_at_nul(path: str) -> str:
    return path.partition("\x00")[0]


def _backslashes(path: str) -> str:
    return path.replace("\\", "/")


def _windows_trim(path: str) -> str:
    # A segment of dots only (`..`) is a dot segment, not trimmed to nothing.
    return "/".join(s if s.strip(".") == "" else s.rstrip(" .") for s in path.split("/"))


def _strip_parameters(path: str) -> str:
    return _SEGMENT_PARAMETERS.sub("", path)


def _trim_segments(path: str) -> str:
    # Spring's AntPathMatcher trims each segment (trimTokens): `..%09` is `..` there.
    return "/".join(s.strip(_BLANK) for s in path.split("/"))


def _trim_path(path: str) -> str:
    # Python's `$` matches before a final `\n`: Starlette's `^/payments$` takes `/payments\n`.
    return path.rstrip(_BLANK)  # the path starts with `/`: only its end can be trimmed


def _merge_slashes(path: str) -> str:
    return _REPEATED_SLASHES.sub("/", path)


def remove_dot_segments(path: str) -> str:
    """RFC 3986 §5.2.4, for an absolute path."""
    if "/." not in path:
        return path
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
# cut from segments (Spring trims what is left), then the path is resolved.
_STEPS: tuple[Step, ...] = (
    _end_at_nul,
    _backslashes,
    _windows_trim,
    _strip_parameters,
    _trim_segments,
    _trim_path,
    _merge_slashes,
    remove_dot_segments,
)


def changeable(path: str) -> bool:
    """Whether any step could change `path` (a decoded path, aiohttp's `request.path`)."""
    return _CHANGEABLE.search(path) is not None


def opaque(raw: str) -> str | None:
    """The raw path decoded but for `%2F` and `%5C`, which stay one segment's characters (as
    a WHATWG parser keeps them, RFC 3986 §2.2); None when it has neither (it is the decoded
    path)."""
    if _ENCODED_SEPARATOR.search(raw) is None:
        return None
    kept = raw.replace("%2f", "%2F").replace("%5c", "%5C")
    pieces = kept.split("%2F")
    return _SLASH.join(_BACKSLASH.join(map(unquote, p.split("%5C"))) for p in pieces)


def without_authority(path: str) -> set[str]:
    """The paths left once a leading `//authority` is dropped from `path`: as RFC 3986 §3.2 reads
    it (after exactly `//`, up to `/`, `?` or `#`) and as WHATWG does for a special scheme
    (after every leading `/` and `\\`, up to any of those or `\\`); none when `path` starts with
    fewer than two separators."""
    if _AUTHORITY.match(path) is None:
        return set()
    found = {_rest(_WHATWG_HOST.sub("", path.lstrip("/\\"), count=1))}
    if path.startswith("//"):
        found.add(_rest(_RFC_AUTHORITY.sub("", path[2:], count=1)))
    return found


def _rest(rest: str) -> str:
    # What follows the authority: a path (WHATWG takes `\\` for its `/`), or else none: `/`.
    return "/" + rest[1:] if rest[:1] in ("/", "\\") else "/"


def _after_steps(path: str) -> set[str]:
    """`path` after every subset of the steps, in their order: each step runs once on every
    path found so far, and a path that several subsets reach is taken on once."""
    found = {path}
    for step in _STEPS:
        found |= {step(p) for p in found}
    return found


def readings(path: str, raw: str | None = None) -> Iterator[str]:
    """Every other path a backend may take `path` (decoded) for; with `raw` (the path as sent),
    also those taken on it with its encoded separators kept (`opaque`), then decoded. Each is
    taken as it is and with a leading `//authority` dropped (`without_authority`)."""
    seen = {path}
    starts = [path]
    kept = None if raw is None else opaque(raw)
    if kept is not None:
        starts.append(kept)
    for start in starts:
        found = set().union(*map(_after_steps, (start, *without_authority(start))))
        for path_read in found:
            reading = path_read.replace(_SLASH, "/").replace(_BACKSLASH, "\\")
            if reading not in seen:
                seen.add(reading)
                yield reading
