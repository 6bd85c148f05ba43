"""Durations and sizes as people write them (`30s`, `10MiB`), bare numbers still accepted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from idemproxy.cli.main import main
from idemproxy.config.settings import Settings, load_settings
from idemproxy.config.units import parse_duration, parse_size

UPSTREAM = "http://127.0.0.1:9"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("250ms", 0.25),
        ("30s", 30.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("1d", 86400.0),
        ("1h30m", 5400.0),
        ("1.5s", 1.5),
        ("30", 30.0),
        ("0.05", 0.05),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("512KiB", 512 * 1024),
        ("10MiB", 10 * 1024**2),
        ("1GiB", 1024**3),
        ("10Mi", 10 * 1024**2),
        ("1GB", 10**9),
        ("64kB", 64_000),
        ("1k", 1000),
        ("1.5KiB", 1536),
        ("1 MiB", 1024**2),
        ("100B", 100),
        ("1048576", 1048576),
    ],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["abc", "5x", "m", "1m5", "30 s", "-1s"])
def test_not_a_duration(text: str) -> None:
    with pytest.raises(ValueError, match=r"is not a duration: give seconds, or e\.g\. 250ms"):
        parse_duration(text)


@pytest.mark.parametrize("text", ["abc", "5x", "10MB/s", "-5", "1e6"])
def test_not_a_size(text: str) -> None:
    with pytest.raises(ValueError, match=r"is not a size: give bytes, or e\.g\. 512KiB"):
        parse_size(text)


def test_a_fraction_of_a_byte_is_refused() -> None:
    with pytest.raises(ValueError, match="not a whole number of bytes"):
        parse_size("1.1B")


@given(st.integers(min_value=0, max_value=10**7), st.sampled_from(["ms", "s", "m", "h", "d"]))
def test_a_duration_round_trips(number: int, unit: str) -> None:
    factor = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}[unit]
    assert parse_duration(f"{number}{unit}") == pytest.approx(number * factor)


@given(
    st.integers(min_value=0, max_value=2**20),
    st.sampled_from(["KiB", "MiB", "GiB", "Ki", "Mi", "kB", "MB", "GB", "B", ""]),
)
def test_a_size_round_trips(number: int, unit: str) -> None:
    factor = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "Ki": 2**10, "Mi": 2**20}.get(unit)
    factor = factor or {"kB": 10**3, "MB": 10**6, "GB": 10**9}.get(unit, 1)
    assert parse_size(f"{number}{unit}") == number * factor
    assert parse_size(f"{number}{unit.lower()}") == number * factor


def test_every_source_takes_units(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "idemproxy.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "upstream": UPSTREAM,
                "ttl": "7d",
                "server": {"spool_threshold": "2MiB", "shutdown_timeout": "1m"},
                "redis": {"timeout": "50ms"},
                "replay_cache": {"max_bytes": "64MiB"},
            }
        )
    )
    monkeypatch.setenv("IDEMPROXY_LIMITS__RESPONSE_BUFFER", "128MiB")
    monkeypatch.setenv("IDEMPROXY_UPSTREAM_TIMEOUT", "45s")
    settings = load_settings(config, max_request_body="20MiB", lease="15s")
    assert settings.ttl == 7 * 86400
    assert settings.server.spool_threshold == 2 * 1024**2
    assert settings.server.shutdown_timeout == 60
    assert settings.redis.timeout == 0.05
    assert settings.replay_cache.max_bytes == 64 * 1024**2
    assert settings.limits.response_buffer == 128 * 1024**2
    assert settings.upstream_timeout == 45
    assert settings.max_request_body == 20 * 1024**2
    assert settings.lease == 15
    assert settings.effective_max_wait == 50


def test_route_durations_take_units(tmp_path: Path) -> None:
    schema, samples = tmp_path / "schema.json", tmp_path / "samples.jsonl"
    schema.write_text("{}")
    samples.write_text('{"path": "/"}\n')
    config = tmp_path / "idemproxy.yaml"
    route = {
        "prefix": "/",
        "upstream": UPSTREAM,
        "fallbacks": ["http://127.0.0.1:10"],
        "ttl": "2h",
        "hedge_after": "1500ms",
        "upstream_timeout": "2m",
        "contract": {
            "schema_file": str(schema),
            "samples_file": str(samples),
            "interval": "5m",
            "timeout": "30s",
        },
    }
    config.write_text(yaml.safe_dump({"routes": [route, {**route, "prefix": "/bare", "ttl": 90}]}))
    first, bare = load_settings(config).routes
    assert (first.ttl, first.hedge_after, first.upstream_timeout) == (7200, 1.5, 120)
    assert first.contract is not None
    assert (first.contract.interval, first.contract.timeout) == (300, 30)
    assert bare.ttl == 90


def _parts(annotation: object) -> Iterator[object]:
    """The annotation and everything it is made of (Optional, list, dict, Annotated)."""
    yield annotation
    for part in get_args(annotation):
        yield from _parts(part)


def _second_fields(model: type[BaseModel]) -> Iterator[tuple[str, list[object]]]:
    """Every float field of `model` and the settings models below it (all of them are seconds),
    with everything its type is annotated with."""
    for name, info in model.model_fields.items():
        parts = list(_parts(info.annotation))
        for kind in parts:
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                yield from ((f"{name}.{inner}", found) for inner, found in _second_fields(kind))
        if float in parts:
            yield name, [*info.metadata, *parts]


def test_every_seconds_setting_is_a_duration() -> None:
    """A float setting without the Duration type would refuse `30s`: none is left."""
    fields = dict(_second_fields(Settings))
    assert {"routes.ttl", "routes.contract.timeout", "lease", "owner.jwt.leeway"} <= set(fields)
    plain = [
        name
        for name, found in fields.items()
        if not any(getattr(m, "func", None) is parse_duration for m in found)
    ]
    assert plain == []


def test_bare_numbers_still_read() -> None:
    settings = load_settings(upstream=UPSTREAM, ttl=60, max_stored_body=1024, lease="12.5")
    assert (settings.ttl, settings.max_stored_body, settings.lease) == (60, 1024, 12.5)


def test_the_error_names_the_field() -> None:
    with pytest.raises(ValidationError) as caught:
        load_settings(upstream=UPSTREAM, server={"spool_threshold": "10 parsecs"})
    [error] = caught.value.errors()
    assert error["loc"] == ("server", "spool_threshold")
    assert "'10 parsecs' is not a size" in error["msg"]


def test_the_field_constraint_still_applies_after_the_unit() -> None:
    with pytest.raises(ValidationError, match="greater than 0"):
        load_settings(upstream=UPSTREAM, lease="0s")


def test_the_flags_take_units(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve", "--upstream", UPSTREAM, "--ttl", "soon", "--max-stored-body", "1MiB"])
    assert code == 2
    assert capsys.readouterr().err == (
        "idemproxy: invalid configuration: ttl: Value error, 'soon' is not a duration:"
        " give seconds, or e.g. 250ms, 30s, 5m, 1h\n"
    )


@pytest.mark.parametrize("text", ["30m1h", "1s1s", "1m1h", "500ms1s", "1h1h30m"])
def test_units_come_once_and_largest_first(text: str) -> None:
    with pytest.raises(ValueError, match=r"give each unit once, largest first"):
        parse_duration(text)


# Arabic-Indic and fullwidth digits, which int(), float() and Decimal() all read.
@pytest.mark.parametrize(
    "text", ["\u0661\u0662s", "\u0661\u0662", "\uff11\uff12s", "1_000", "\u0663MiB", "\uff11KiB"]
)
def test_only_ascii_digits(text: str) -> None:
    with pytest.raises(ValueError, match=r"is not a (duration|size)"):
        (parse_size if "B" in text else parse_duration)(text)


@pytest.mark.parametrize("field", ["ttl", "max_stored_body"])
@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_is_neither_a_duration_nor_a_size(field: str, value: bool) -> None:
    with pytest.raises(ValidationError) as caught:
        overrides: dict[str, Any] = {field: value}
        load_settings(upstream=UPSTREAM, **overrides)
    assert caught.value.errors()[0]["loc"] == (field,)


@pytest.mark.parametrize("value", ["1e300", 1e300, "3651d", float("inf"), 10**12])
def test_a_duration_longer_than_ten_years_is_refused(value: object) -> None:
    """A route ttl of 1e300 s overflowed the job's expiry datetime on every request."""
    route = {"prefix": "/", "upstream": UPSTREAM, "ttl": value}
    with pytest.raises(ValidationError) as caught:
        load_settings(routes=[route])
    [error] = caught.value.errors()
    assert error["loc"] == ("routes", 0, "ttl")
    assert "at most 3650d (ten years)" in error["msg"]
    with pytest.raises(ValidationError, match="at most 3650d"):
        load_settings(upstream=UPSTREAM, lease=value)


def test_the_longest_duration_and_size_are_accepted() -> None:
    settings = load_settings(upstream=UPSTREAM, ttl="3650d", max_request_body="1024TiB")
    assert settings.ttl == 3650 * 86400
    assert settings.max_request_body == 2**50
    with pytest.raises(ValidationError, match=r"at most 1125899906842624 bytes"):
        load_settings(upstream=UPSTREAM, max_request_body="1025TiB")
    with pytest.raises(ValidationError, match=r"at most 1125899906842624 bytes"):
        load_settings(upstream=UPSTREAM, max_request_body=10**30)


def test_the_forward_host_flag_sets_the_upstream_routes_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from idemproxy.cli.main import _parser, _settings

    args = _parser().parse_args(
        ["serve", "--upstream", UPSTREAM, "--forward-host", "backend.internal:8080"]
    )
    [route] = _settings(args, {"upstream": "upstream", "forward_host": "forward_host"}).all_routes
    assert route.forward_host == "backend.internal:8080"
