"""Redis is an optional extra (`idemproxy[redis]`). Without the package the core imports and runs;
asking for it then is a clear start-up error. With it, `--redis` / `IDEMPROXY_REDIS` turn the cache
on."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest
from pydantic import ValidationError

from idemproxy.cli import main as cli
from idemproxy.config.settings import Settings, load_settings
from idemproxy.store.factory import create_store, wrap_with_cache
from idemproxy.store.redis.cache import RedisCachedStore

UPSTREAM = "http://127.0.0.1:9"

WITHOUT_REDIS = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    sys.modules["redis"] = None  # as if `idemproxy[redis]` were not installed
    import idemproxy
    for info in pkgutil.walk_packages(idemproxy.__path__, "idemproxy."):
        if info.name != "idemproxy.__main__" and not info.name.startswith("idemproxy.store.redis"):
            importlib.import_module(info.name)
    from idemproxy.config.settings import load_settings
    from idemproxy.store.factory import create_store, wrap_with_cache
    store = create_store("sqlite://:memory:")
    assert wrap_with_cache(store, load_settings(upstream="http://127.0.0.1:9")) is store
    from idemproxy.cli.main import main
    code = main(["serve", "--upstream", "http://127.0.0.1:9", "--store", "sqlite://:memory:",
                 "--redis", "redis://127.0.0.1:9/0"])
    print("exit", code)
    """
)


def test_the_core_imports_and_runs_without_redis_and_asking_for_it_fails_clearly() -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_REDIS],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("exit 2"), done.stdout
    assert "pip install 'idemproxy[redis]'" in done.stderr


def test_the_flag_sets_redis(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Settings] = []
    monkeypatch.setattr("idemproxy.cli.serve.serve", lambda settings, *_: seen.append(settings))
    argv = ["serve", "--upstream", UPSTREAM, "--redis", "redis://cache:6379/0"]
    assert cli.main(argv) == 0
    assert seen[0].redis.url == "redis://cache:6379/0"


def test_the_environment_sets_redis_and_its_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IDEMPROXY_REDIS", "redis://:secret@cache:6379/1")
    monkeypatch.setenv("IDEMPROXY_REDIS_OPTIONS__TIMEOUT", "0.02")
    settings = load_settings(upstream=UPSTREAM)
    assert settings.redis.url == "redis://:secret@cache:6379/1"
    assert settings.redis.timeout == 0.02
    assert load_settings(upstream=UPSTREAM, redis=None).redis.ttl == 300


@pytest.mark.parametrize("url", ["http://cache:6379", "cache:6379", "postgresql://x/y"])
def test_a_redis_url_of_another_scheme_is_refused_naming_the_field(url: str) -> None:
    with pytest.raises(ValidationError, match="redis"):
        load_settings(upstream=UPSTREAM, redis=url)


async def test_the_factory_wraps_the_store_only_when_asked() -> None:
    settings = load_settings(upstream=UPSTREAM)
    store = create_store("sqlite://:memory:")
    assert wrap_with_cache(store, settings) is store

    options: dict[str, Any] = {"timeout": 0.02, "ttl": 60, "max_body": 10}
    settings = load_settings(
        upstream=UPSTREAM, redis="redis://127.0.0.1:9/0", redis_options=options
    )
    wrapped = wrap_with_cache(store, settings)
    assert isinstance(wrapped, RedisCachedStore)
    assert wrapped.inner is store
    assert wrapped.watch is store.watch  # one set of waiters for both feeds
    await wrapped.cache.client.aclose()  # never opened: nothing else to close


def test_an_empty_redis_url_means_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IDEMPROXY_REDIS", "")
    assert load_settings(upstream=UPSTREAM).redis.url is None
