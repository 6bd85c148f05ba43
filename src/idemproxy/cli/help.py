"""`--help` that says, for every flag, its default and the environment variable of its setting
(SPEC §12: file < environment < flags), read from the settings model so it cannot drift."""

from __future__ import annotations

import argparse
from typing import Any

from idemproxy.config.settings import Settings

CONFIG_VARIABLE = "IDEMPROXY_CONFIG"
_ENV_PREFIX = "IDEMPROXY_"

# Each command's flags that set a setting: its `prog` → {flag dest → dotted setting}.
SETTING_FLAGS: dict[str, dict[str, str]] = {}


def env_variable(setting: str) -> str:
    """IDEMPROXY_<FIELD>, nested with `__` (server.workers → IDEMPROXY_SERVER__WORKERS)."""
    return _ENV_PREFIX + setting.upper().replace(".", "__")


def setting_default(setting: str) -> Any:
    value: Any = Settings.model_construct()  # the defaults, without reading any source
    for part in setting.split("."):
        value = getattr(value, part)
    return value


def describe_setting_flags(parser: argparse.ArgumentParser, flags: dict[str, str]) -> None:
    """Append the default and the environment variable to each flag of `flags` (dest → setting)."""
    SETTING_FLAGS[parser.prog] = dict(flags)
    for action in parser._actions:
        setting = flags.get(action.dest)
        if setting is None or action.help == argparse.SUPPRESS:
            continue
        notes = []
        if not _says_default(action.help):
            notes.append(f"default {_shown(setting_default(setting))}")
        notes.append(f"env {env_variable(setting)}")
        action.help = _joined(action.help, notes)


def describe_defaults(parser: argparse.ArgumentParser) -> None:
    """For every command below `parser`: the default of each flag that has one, and the
    variable `--config` is read from, where the help does not say them yet."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                describe_defaults(sub)
            continue
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if action.dest == "config" and CONFIG_VARIABLE not in (action.help or ""):
            action.help = _joined(action.help, [f"env {CONFIG_VARIABLE}"])
        elif _has_default(action) and not _says_default(action.help):
            action.help = _joined(action.help, [f"default {_shown(action.default)}"])


def _has_default(action: argparse.Action) -> bool:
    if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return False
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return False  # a switch: its help says what it turns on
    return action.default not in (None, [], argparse.SUPPRESS)


def _says_default(text: str | None) -> bool:
    return text is not None and "default" in text


def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return ",".join(str(item) for item in value) or "none"
    return str(value)


def _joined(text: str | None, notes: list[str]) -> str:
    # `%` is a format character in argparse help texts.
    suffix = "; ".join(notes).replace("%", "%%")
    return f"{text} ({suffix})" if text else suffix[:1].upper() + suffix[1:]
