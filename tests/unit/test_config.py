"""Settings: precedence, validation that names the field, and a documented example."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from idemproxy.config.settings import Settings, load_settings, log_settings_warnings
from idemproxy.errors import ConfigError
from idemproxy.observe.metrics import Metrics
from idemproxy.proxy.routing import RouteTable

EXAMPLE = Path(__file__).parents[2] / "config" / "idemproxy.example.yaml"


def _write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "idemproxy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_defaults_follow_the_spec() -> None:
    settings = load_settings(upstream="http://127.0.0.1:9")
    assert settings.listen == "127.0.0.1:8080"
    assert settings.store == "sqlite:///idemproxy.db"
    assert settings.methods == ["POST", "PATCH"]
    assert settings.ttl == 86400
    assert settings.upstream_timeout == 30
    assert settings.effective_max_wait == 35
    assert settings.max_request_body == 10 * 1024 * 1024
    assert settings.max_stored_body == 8 * 1024 * 1024


def test_file_then_environment_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _write(tmp_path, {"upstream": "http://file:1", "ttl": 10, "profile": "ietf"})
    monkeypatch.setenv("IDEMPROXY_TTL", "20")
    monkeypatch.setenv("IDEMPROXY_OWNER__STRATEGY", "header:X-User")
    settings = load_settings(config, ttl=30)
    assert settings.upstream == "http://file:1"
    assert settings.profile == "ietf"
    assert settings.owner.strategy == "header:X-User"
    assert settings.ttl == 30
    assert load_settings(config).ttl == 20


def test_nested_flag_keeps_the_rest_of_the_section(tmp_path: Path) -> None:
    config = _write(tmp_path, {"upstream": "http://x:1", "owner": {"required": True}})
    settings = load_settings(config, owner={"strategy": "none"})
    assert (settings.owner.strategy, settings.owner.required) == ("none", True)


def test_methods_accept_a_comma_list() -> None:
    assert load_settings(upstream="http://x:1", methods="post, put").methods == ["POST", "PUT"]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"ttl": -1}, "ttl"),
        ({"listen": "nonsense"}, "listen"),
        ({"upstream": "ftp://x"}, "upstream"),
        ({"store": "mysql://x"}, "store"),
        ({"profile": "strict"}, "profile"),
        ({"owner": {"strategy": "bogus"}}, "owner.strategy"),
        ({"fingerprint_exclude": ["nonce"]}, "fingerprint_exclude"),
        ({"fingerprint_headers": ["Stripe Account"]}, "fingerprint_headers"),
        ({"fingerprint_headers": ["Stripe-Account", "stripe-account"]}, "fingerprint_headers"),
        ({"routes": [{"prefix": "api", "upstream": "http://x:1"}]}, "routes.0.prefix"),
        ({"no_such_setting": 1}, "no_such_setting"),
        ({"pool": {"upstream_keepalive": -1}}, "pool.upstream_keepalive"),
    ],
)
def test_bad_values_name_the_field(overrides: dict[str, Any], field: str) -> None:
    base = {"upstream": "http://x:1"}
    with pytest.raises(ValidationError) as caught:
        load_settings(**{**base, **overrides})
    locations = {".".join(str(p) for p in error["loc"]) for error in caught.value.errors()}
    assert field in locations


def test_upstream_keepalive_zero_reuses_no_connection() -> None:
    """docs/operations.md, "Bytes from an upstream after its answer": 0 is a setting."""
    settings = load_settings(upstream="http://x:1", pool={"upstream_keepalive": 0})
    assert settings.pool.upstream_keepalive == 0


def test_an_upstream_is_required() -> None:
    with pytest.raises(ValidationError, match="upstream"):
        load_settings()


def test_routes_longest_prefix_then_host() -> None:
    settings = load_settings(
        upstream="http://default:1",
        routes=[
            {"prefix": "/api", "upstream": "http://api:1"},
            {"prefix": "/api/pay", "upstream": "http://pay:1", "require_key": True},
            {"prefix": "/api", "host": "eu.example.com", "upstream": "http://eu:1"},
        ],
    )
    table = RouteTable.from_settings(settings)

    def upstream(path: str, host: str | None = None) -> str:
        route = table.find(path, host)
        assert route is not None
        return route.upstream

    assert upstream("/api/pay/1") == "http://pay:1"
    assert upstream("/api/other") == "http://api:1"
    assert upstream("/api/other", "eu.example.com:443") == "http://eu:1"
    assert upstream("/apiary") == "http://default:1"
    assert upstream("/") == "http://default:1"
    pay = table.find("/api/pay", None)
    assert pay is not None and pay.require_key and pay.ttl == settings.ttl


def _documented_keys(model: type[BaseModel]) -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        keys.add(name)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys |= {f"{name}.{sub}" for sub in _documented_keys(annotation)}
    return keys


def _keys_in(data: dict[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for name, value in data.items():
        keys.add(prefix + name)
        if isinstance(value, dict):
            keys |= _keys_in(value, f"{prefix}{name}.")
    return keys


def test_example_config_documents_every_setting_and_loads() -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    assert _keys_in(data) == _documented_keys(Settings)
    assert load_settings(EXAMPLE).upstream == "http://127.0.0.1:3000"


def test_admin_token_is_required_off_loopback() -> None:
    with pytest.raises(ValidationError, match=r"admin\.token"):
        load_settings(upstream="http://x:1", admin={"listen": "0.0.0.0:9090"})
    admin = {"listen": "0.0.0.0:9090", "token": "tok-3141"}
    settings = load_settings(upstream="http://x:1", admin=admin)
    assert settings.admin.token is not None
    assert "tok-3141" not in repr(settings)  # a secret never shows in logs or errors
    assert load_settings(upstream="http://x:1", admin={"listen": "[::1]:9090"}).admin.token is None


def test_lists_from_the_environment_are_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IDEMPROXY_METHODS", "POST,PUT")
    monkeypatch.setenv("IDEMPROXY_FALLBACKS", "http://b:1, http://c:1")
    monkeypatch.setenv("IDEMPROXY_FINGERPRINT_EXCLUDE", "/nonce,/ts")
    monkeypatch.setenv("IDEMPROXY_FINGERPRINT_HEADERS", "Stripe-Account, OpenAI-Project")
    settings = load_settings(upstream="http://a:1")
    assert settings.fingerprint_headers == ["stripe-account", "openai-project"]
    assert settings.methods == ["POST", "PUT"]
    assert settings.fallbacks == ["http://b:1", "http://c:1"]
    assert settings.fingerprint_exclude == ["/nonce", "/ts"]


@pytest.mark.parametrize(
    ("lease", "store_timeout", "refused"),
    [(10.0, 5.0, False), (7.5, 5.0, True), (3.0, 5.0, True), (1.0, 0.5, False), (1.0, 0.7, True)],
)
def test_a_lease_renewal_must_fit_in_the_lease(
    lease: float, store_timeout: float, refused: bool
) -> None:
    """SPEC §3.5: a renewal due after lease / 3 that may take pool.store_timeout to fail must
    end before the lease does."""
    settings: dict[str, Any] = {
        "upstream": "http://u:1",
        "lease": lease,
        "pool": {"store_timeout": store_timeout},
    }
    if not refused:
        assert load_settings(**settings).lease == lease
        return
    with pytest.raises(ValidationError) as caught:
        load_settings(**settings)
    (error,) = caught.value.errors()
    assert error["loc"] == ("pool",)
    assert "lease" in error["msg"] and "pool.store_timeout" in error["msg"]


@pytest.mark.parametrize(
    "second",
    [
        {"prefix": "/pay", "upstream": "http://other:1"},
        {"prefix": "/pay", "host": "API.example.com", "upstream": "http://other:1"},
        # The name routing compares: no port, no trailing dot (proxy/routing.py).
        {"prefix": "/pay", "host": "api.example.com.:443", "upstream": "http://other:1"},
    ],
)
def test_two_routes_of_one_prefix_and_host_are_refused(second: dict[str, Any]) -> None:
    """The second would never be used: its upstream, key source and limits neither."""
    first = {"prefix": "/pay", "upstream": "http://pay:1", "require_key": True}
    if "host" in second:
        first["host"] = "api.example.com"
    with pytest.raises(ValidationError, match=r"routes\[1\] has the prefix /pay"):
        load_settings(routes=[first, second])
    # One prefix on two hosts, or with a host and without, are two routes.
    load_settings(routes=[first, {**second, "host": "eu.example.com"}])


def test_a_prefix_that_takes_every_path_of_another_is_refused() -> None:
    """`/pay//` takes every path `/pay/` does, and is the longer: `/pay/` would never be used.
    `/pay` and `/pay/` are two routes: the first still takes `/pay` itself."""
    with pytest.raises(ValidationError, match=r"routes\[1\] has the prefix /pay//"):
        load_settings(
            routes=[
                {"prefix": "/pay/", "upstream": "http://pay:1"},
                {"prefix": "/pay//", "upstream": "http://other:1"},
            ]
        )
    load_settings(
        routes=[
            {"prefix": "/pay", "upstream": "http://pay:1"},
            {"prefix": "/pay/", "upstream": "http://other:1"},
        ]
    )


@pytest.mark.parametrize("prefix", ["/", "//"])
def test_upstream_beside_a_route_that_takes_every_path_is_warned_of(
    prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`upstream` is the catch-all route `/`, after the configured ones: beside a route of
    every path and any host no request reaches it, and the start says so (a warning, not a
    refusal: a deployment may set `upstream` for every proxy, the chart's sidecar mode does)."""
    settings = load_settings(
        upstream="http://never:1", routes=[{"prefix": prefix, "upstream": "http://app:1"}]
    )
    with caplog.at_level(logging.WARNING, logger="idemproxy"):
        log_settings_warnings(settings)
    assert "upstream http://never:1 is never used: routes[0]" in caplog.text
    for used in (
        load_settings(
            upstream="http://rest:1", routes=[{"prefix": "/a", "upstream": "http://a:1"}]
        ),
        load_settings(
            upstream="http://rest:1",
            routes=[{"prefix": "/", "host": "api.example.com", "upstream": "http://app:1"}],
        ),
    ):
        assert used.unused_upstream is None


def test_forward_host_is_auto_by_default_for_every_route() -> None:
    """SPEC §10: `auto` (the client's Host for http://, the upstream's for https://)."""
    settings = load_settings(
        upstream="http://127.0.0.1:9", routes=[{"prefix": "/a", "upstream": "https://api.test"}]
    )
    assert settings.forward_host == "auto"
    assert [route.forward_host for route in RouteTable.from_settings(settings).routes] == [
        "auto",
        "auto",
    ]


@pytest.mark.parametrize(
    "value", ["auto", "client", "upstream", "api.example.com", "backend:8080", "[::1]:80"]
)
def test_forward_host_takes_a_mode_or_a_host(value: str) -> None:
    settings = load_settings(
        upstream="http://127.0.0.1:9",
        forward_host=value,
        routes=[{"prefix": "/a", "upstream": "http://127.0.0.1:9", "forward_host": value}],
    )
    assert {route.forward_host for route in RouteTable.from_settings(settings).routes} == {value}


@pytest.mark.parametrize(
    "value",
    ["", "Client", "a b", "a, b", "user@host", "host/path", "http://host", ":80", "h\r\nX: y"],
)
def test_a_forward_host_that_is_no_host_is_refused_naming_the_field(value: str) -> None:
    with pytest.raises(ValidationError, match="forward_host"):
        load_settings(upstream="http://127.0.0.1:9", forward_host=value)
    route = {"prefix": "/a", "upstream": "http://127.0.0.1:9", "forward_host": value}
    with pytest.raises(ValidationError, match="forward_host"):
        load_settings(upstream="http://127.0.0.1:9", routes=[route])


def test_metric_buckets_reach_the_longest_route_timeout(tmp_path: Path) -> None:
    config = tmp_path / "idemproxy.yaml"
    config.write_text(
        "routes:\n"
        "  - {prefix: /v1, upstream: 'https://api.example.com', upstream_timeout: 300}\n"
        "  - {prefix: /, upstream: 'http://127.0.0.1:3000'}\n"
    )
    settings = load_settings(config)
    assert settings.longest_upstream_timeout == 300
    assert _bounds(Metrics.for_settings(settings))[-3:] == [120.0, 300.0, float("inf")]


@pytest.mark.parametrize("buckets", [[1, 0.5], [0, 1], [1, 1], []])
def test_metric_buckets_must_be_positive_and_ascending(buckets: list[float]) -> None:
    with pytest.raises(ValidationError, match="buckets"):
        load_settings(upstream="http://127.0.0.1:9", metrics={"buckets": buckets})


def test_configured_metric_buckets_are_used() -> None:
    settings = load_settings(upstream="http://127.0.0.1:9", metrics={"buckets": [0.1, 1, 600]})
    assert _bounds(Metrics.for_settings(settings)) == [0.1, 1, 600, float("inf")]


def _bounds(metrics: Metrics) -> list[float]:
    """The `le` bounds of the upstream histogram, as /metrics shows them."""
    metrics.upstream_seconds.labels("answered", "http://a:80").observe(0.2)
    return [
        float(sample.labels["le"])
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == "idemproxy_upstream_seconds_bucket"
    ]


@pytest.mark.parametrize("token", ["", "   ", "\n"])
def test_an_empty_or_blank_admin_token_off_loopback_is_refused(token: str) -> None:
    """An empty token turned the admin API's authentication off: every owner's jobs open to
    the network (SPEC §13)."""
    with pytest.raises(ValidationError, match=r"admin\.token"):
        load_settings(upstream="http://x:1", admin={"listen": "0.0.0.0:9090", "token": token})


@pytest.mark.parametrize("name", ["", "Idempotency-Key ", "Idempotency-Key\n", "Idem Key"])
def test_a_key_header_that_is_no_header_name_is_refused(name: str) -> None:
    """No request could carry it: every keyed request would pass through untracked."""
    with pytest.raises(ValidationError, match="key_header"):
        load_settings(upstream="http://x:1", key_header=name)


@pytest.mark.parametrize("methods", ["", " , ", "PO ST", "POST,GET/1"])
def test_methods_that_name_no_method_are_refused(methods: str) -> None:
    with pytest.raises(ValidationError, match="methods"):
        load_settings(upstream="http://x:1", methods=methods)


def test_methods_from_the_environment_as_a_json_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the other lists may be given: the JSON list form was split on its commas, into the
    method names `["POST"` and `"PATCH"]`, and nothing was governed."""
    monkeypatch.setenv("IDEMPROXY_METHODS", '["POST", "patch"]')
    assert load_settings(upstream="http://a:1").methods == ["POST", "PATCH"]


@pytest.mark.parametrize(
    ("release", "unknown"),
    [([408, 502], [502, 504]), ([201, 503], [502]), ([99], [502]), ([503], [600])],
    ids=["in both lists", "a success released", "no status", "no status unknown"],
)
def test_outcome_lists_that_contradict_are_refused(release: list[int], unknown: list[int]) -> None:
    """SPEC §3.2: a status that may have executed must never release its job."""
    outcomes = {"release_statuses": release, "unknown_statuses": unknown}
    with pytest.raises(ValidationError, match="status"):
        load_settings(upstream="http://x:1", outcomes=outcomes)


@pytest.mark.parametrize("pepper", ["k" * 20 + "0123456789abcdef\n", " " + "0123456789abcdef" * 3])
def test_a_pepper_with_whitespace_at_its_ends_is_refused(pepper: str) -> None:
    """pepper_file drops its final line break: the same secret given inline with it would be
    another key, every owner another, and every retry would execute again."""
    with pytest.raises(ConfigError, match=r"owner\.pepper: whitespace"):
        load_settings(upstream="http://x:1", owner={"pepper": pepper})


_PEPPER = "0123456789abcdef" * 3


@pytest.mark.parametrize(
    "content",
    [_PEPPER + "  \n", _PEPPER + "\n\n", "\ufeff" + _PEPPER + "\n", "\t" + _PEPPER],
    ids=["trailing blanks", "two line breaks", "byte order mark", "leading tab"],
)
def test_a_pepper_file_with_more_than_a_final_line_break_is_refused(
    tmp_path: Path, content: str
) -> None:
    """Its one final line break is dropped, nothing else: the same secret moved to the inline
    form (which refuses whitespace at its ends) would otherwise be another key, every owner
    another, and every retry would execute again."""
    pepper_file = tmp_path / "pepper"
    pepper_file.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match=r"owner\.pepper_file: whitespace"):
        load_settings(upstream="http://x:1", owner={"pepper_file": str(pepper_file)})


def test_a_pepper_file_with_one_final_line_break_is_the_inline_pepper(tmp_path: Path) -> None:
    pepper_file = tmp_path / "pepper"
    pepper_file.write_text(_PEPPER + "\n", encoding="utf-8")
    from_file = load_settings(upstream="http://x:1", owner={"pepper_file": str(pepper_file)})
    inline = load_settings(upstream="http://x:1", owner={"pepper": _PEPPER})
    assert from_file.owner.pepper is not None and inline.owner.pepper is not None
    assert from_file.owner.pepper.get_secret_value() == inline.owner.pepper.get_secret_value()


@pytest.mark.parametrize("methods", ["[null]", "[1]", '["POST", true]'])
def test_methods_given_as_other_than_strings_are_refused(
    monkeypatch: pytest.MonkeyPatch, methods: str
) -> None:
    """`[null]` governed a method named NONE: every POST passed through untracked."""
    monkeypatch.setenv("IDEMPROXY_METHODS", methods)
    with pytest.raises(ValidationError, match="methods"):
        load_settings(upstream="http://a:1")


@pytest.mark.parametrize(
    "name",
    [
        "Host",
        "transfer-encoding",
        "Content-Length",
        "Connection",
        "Idempotency-Job",
        "X-Forwarded-For",
        "Forwarded",
        "traceparent",
    ],
)
def test_a_key_header_the_proxy_frames_or_sets_is_refused(name: str) -> None:
    """With `Transfer-Encoding`, every chunked request of an owner shared the key `chunked`:
    409s, or replays of another request's answer (SPEC §4.1)."""
    with pytest.raises(ValidationError, match="cannot carry a key"):
        load_settings(upstream="http://x:1", key_header=name)
    route = {"prefix": "/", "upstream": "http://x:1", "key": {"header": name}}
    with pytest.raises(ValidationError, match="cannot carry a key"):
        load_settings(upstream="http://x:1", routes=[route])
