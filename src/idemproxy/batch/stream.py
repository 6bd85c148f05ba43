"""Pure: the usage a streamed answer (`text/event-stream`, `"stream": true`) reports, if any.

A streamed answer is server-sent events (WHATWG HTML §9.2), each event's `data` a JSON object.
LLM APIs put the usage in some of them:

    OpenAI chat completions   a last chunk `{"choices": [], "usage": {…}}`, sent only when the
                              request asks for it (`"stream_options": {"include_usage": true}`)
    OpenAI responses          `response.completed`: `{"response": {"usage": {…}}}`
    Anthropic messages        `message_start`: `{"message": {"usage": {"input_tokens", …}}}`,
                              then `message_delta`: `{"usage": {"output_tokens": …}}`, whose
                              counts are cumulative and replace the start's

The pointers (the run's, then the built-in ones) are tried on each event, the last first; then
on the usage objects of all events merged in order, a later count replacing an earlier one. A
stream without usage reports none, and so does one that did not finish (an `error` event, or an
Anthropic stream cut off after `message_start`): the budget then counts the item at its worst
case (SPEC §14).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

EVENT_STREAM = "text/event-stream"
# WHATWG HTML §9.2.6: a line ends in CRLF, LF or CR (and nothing else: not U+2028, which JSON
# strings may hold raw, as str.splitlines would split on).
_LINE_END = re.compile(r"\r\n|\r|\n")
# Where each API keeps the usage object in an event.
_HOLDERS = ((), ("message",), ("response",))


def is_event_stream(content_type: str | None) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() == EVENT_STREAM


def usage_documents(text: str) -> list[Mapping[str, Any]]:
    """Where to look for the stream's usage, in order: its events, last first, then their usage
    objects merged (`{"usage": {…}}`), for the usage pointers to read (usage.py)."""
    events = list(_events(text))
    if not _finished(events):
        return []  # what it said so far is not what it used: counted at its worst case
    merged: dict[str, Any] = {}
    for event in events:
        for path in _HOLDERS:
            merged.update(_usage_in(event, path) or {})
    return [*reversed(events), {"usage": merged}] if merged else events[::-1]


def _finished(events: list[Mapping[str, Any]]) -> bool:
    """Whether the stream's counts are final: no `error` event (an Anthropic stream cut off by
    `overloaded_error` has generated text it never counted), and an Anthropic stream got past
    `message_start`, whose output count is a placeholder, to a `message_delta` or its stop."""
    kinds = {event.get("type") for event in events}
    if "error" in kinds:
        return False
    return "message_start" not in kinds or bool(kinds & {"message_delta", "message_stop"})


def _usage_in(event: Mapping[str, Any], path: tuple[str, ...]) -> Mapping[str, Any] | None:
    holder: Any = event
    for name in path:
        holder = holder.get(name) if isinstance(holder, Mapping) else None
    usage = holder.get("usage") if isinstance(holder, Mapping) else None
    return usage if isinstance(usage, Mapping) else None


def _events(text: str) -> Iterator[Mapping[str, Any]]:
    """The JSON objects the events carry as `data` (`[DONE]` and other non-JSON data skipped)."""
    for data in _data(text):
        try:
            event = json.loads(data)
        except ValueError:
            continue
        if isinstance(event, Mapping):
            yield event


def _data(text: str) -> Iterator[str]:
    """Each event's data: its `data:` lines joined by newlines (WHATWG HTML §9.2.6)."""
    lines: list[str] = []
    for line in [*_LINE_END.split(text), ""]:
        if not line:  # a blank line ends the event
            if lines:
                yield "\n".join(lines)
            lines = []
            continue
        name, _, value = line.partition(":")
        if name == "data":
            lines.append(value.removeprefix(" "))
