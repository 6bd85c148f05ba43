"""`--help` of every command describes every flag, its default and its environment variable."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator

import pytest

from idemproxy.cli.help import SETTING_FLAGS, env_variable, setting_default
from idemproxy.cli.main import _parser, main


def _commands(
    parser: argparse.ArgumentParser,
) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _commands(sub)


def _options() -> list[tuple[str, argparse.Action]]:
    found = []
    for command in _commands(_parser()):
        for action in command._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            found.append((command.prog, action))
    return found


OPTIONS = _options()


def _id(option: tuple[str, argparse.Action]) -> str:
    return f"{option[0]} {option[1].option_strings[-1]}"


def test_every_command_is_walked() -> None:
    progs = {prog for prog, _ in OPTIONS}
    assert {"idemproxy serve", "idemproxy migrate", "idemproxy jobs resolve"} <= progs
    assert {"idemproxy batch run", "idemproxy batch status", "idemproxy contract check"} <= progs


@pytest.mark.parametrize("option", OPTIONS, ids=_id)
def test_every_flag_says_what_it_does(option: tuple[str, argparse.Action]) -> None:
    _prog, action = option
    assert action.help, "no help text"
    assert not action.help.startswith(("Default", "Env")), "only a default, not what it does"


def _has_default(option: tuple[str, argparse.Action]) -> bool:
    prog, action = option
    if action.dest in SETTING_FLAGS.get(prog, {}):
        return True  # the setting's default
    # A switch, or a flag unset unless given; --config's default is the variable's value.
    return action.default not in (None, [], False) and action.dest != "config"


@pytest.mark.parametrize("option", [o for o in OPTIONS if _has_default(o)], ids=_id)
def test_every_flag_with_a_default_says_it(option: tuple[str, argparse.Action]) -> None:
    _prog, action = option
    assert action.help is not None
    assert "default" in action.help


@pytest.mark.parametrize("option", OPTIONS, ids=_id)
def test_every_flag_that_sets_a_setting_names_its_variable(
    option: tuple[str, argparse.Action],
) -> None:
    prog, action = option
    assert action.help is not None
    if action.dest == "config":
        assert "env IDEMPROXY_CONFIG" in action.help
    elif action.dest == "no_migrate":
        assert "env IDEMPROXY_MIGRATE=false" in action.help
    elif (setting := SETTING_FLAGS.get(prog, {}).get(action.dest)) is not None:
        assert f"env {env_variable(setting)}" in action.help
    else:
        assert "IDEMPROXY_" not in action.help  # no other flag is read from the environment


def test_the_settings_flags_are_registered_for_the_commands_that_read_settings() -> None:
    _parser()
    assert SETTING_FLAGS["idemproxy serve"]["workers"] == "server.workers"
    assert SETTING_FLAGS["idemproxy migrate"] == {"store": "store"}
    assert SETTING_FLAGS["idemproxy jobs list"] == {"store": "store", "redis": "redis.url"}


def test_defaults_come_from_the_settings_model() -> None:
    assert env_variable("owner.jwt.claim") == "IDEMPROXY_OWNER__JWT__CLAIM"
    assert setting_default("owner.jwt.claim") == "sub"
    [workers] = [a for p, a in OPTIONS if p == "idemproxy serve" and a.dest == "workers"]
    assert workers.help is not None
    assert "(default 1; env IDEMPROXY_SERVER__WORKERS)" in workers.help


def test_help_renders(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    assert "env IDEMPROXY_STORE" in out


def test_an_operators_command_starts_without_the_batch_runner_or_an_http_client() -> None:
    """`idemproxy jobs …` at 3 a.m.: the batch runner's and the contract check's imports (an
    HTTP client, a progress display) are theirs alone; every command is still listed, and
    those two still parse their flags when they are the command."""
    probe = (
        "import sys\n"
        "from idemproxy.cli.main import _parser\n"
        "parser = _parser('jobs')\n"
        "loaded = [m for m in ('idemproxy.batch.runner', 'aiohttp.client') if m in sys.modules]\n"
        "print(','.join(loaded) or 'none')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "none"
    with pytest.raises(SystemExit) as unknown:
        _parser("jobs").parse_args(["nonsense"])
    assert unknown.value.code == 2
    args = _parser("batch").parse_args(["batch", "status", "results.jsonl"])
    assert args.run is not None
    assert _parser("contract").parse_args(["contract", "check", "--config", "x.yaml"]).run


@pytest.mark.parametrize("argv", [["-h", "jobs"], ["--help", "batch"], ["-h"]])
def test_the_top_level_help_lists_every_command_whatever_follows_it(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    listed = capsys.readouterr().out
    for command in ("serve", "migrate", "demo", "batch", "contract", "jobs", "store"):
        assert f"    {command} " in listed, command
