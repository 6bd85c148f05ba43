"""What a real `idemproxy serve` process prints at start-up (SPEC §12, §13).

* A credential in the store DSN (the userinfo password, or `?password=` / `?sslpassword=` as
  libpq and asyncpg take them) is never printed.
* A port already in use, or a YAML syntax error, is one line on stderr naming the address, or
  the file, line and column, and a non-zero exit: never a raw traceback.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import pytest

from .conftest import free_port

if TYPE_CHECKING:
    from .conftest import ProxyProcess, RunCli, StartProxy

pytestmark = pytest.mark.slow


async def _logged(proxy: ProxyProcess, text: str, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout
    while text not in proxy.stderr():
        assert loop.time() < until, proxy.describe()
        await asyncio.sleep(0.05)


SECRETS = ("userinfo-s3cret", "query-s3cret", "ssl-s3cret")


@pytest.mark.postgres
async def test_no_credential_of_the_store_dsn_is_printed(
    pg_dsn: str, start_proxy: StartProxy
) -> None:
    parts = urlsplit(pg_dsn)
    # The test server trusts loopback: the passwords are accepted and ignored, as in production
    # they would be checked.
    netloc = f"{parts.username}:{SECRETS[0]}@{parts.hostname}:{parts.port}"
    query = f"password={SECRETS[1]}&sslpassword={SECRETS[2]}&application_name=edge"
    dsn = parts._replace(netloc=netloc, query=query).geturl()
    proxy = await start_proxy("--upstream", "http://127.0.0.1:9", "--store", dsn)
    await _logged(proxy, "listening on")
    code = await proxy.terminate()
    output = proxy.stdout() + proxy.stderr()
    assert code == 0, proxy.describe()
    for secret in SECRETS:
        assert secret not in output
    assert "password=***" in output and "sslpassword=***" in output
    assert f"{parts.username}:***@" in output
    assert "application_name=edge" in output  # the rest stays readable


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port some other process listens on for the length of the test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("setting", ["listen", "admin.listen"])
def test_a_port_in_use_is_one_line_naming_the_address(
    tmp_path: Path, run_cli: RunCli, taken_port: int, setting: str
) -> None:
    taken = f"127.0.0.1:{taken_port}"
    free = f"127.0.0.1:{free_port()}"
    listen, admin = (taken, free) if setting == "listen" else (free, taken)
    store = f"sqlite:///{tmp_path}/x.db"
    done = run_cli(
        "serve", "--upstream", "http://127.0.0.1:9", "--store", store,
        "--listen", listen, "--admin-listen", admin, timeout=20,
    )  # fmt: skip
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == f"idemproxy: {setting}: cannot listen on {taken}: Address already in use"


BROKEN_YAML = {
    "unclosed flow sequence": (
        "upstream: http://127.0.0.1:9\nroutes:\n  - prefix: /a\n    upstream: [unclosed\n",
        "line 5, column 1: expected ',' or ']', but got '<stream end>' "
        "(while parsing a flow sequence at line 4, column 15)",
    ),
    "tab indentation": (
        "upstream: http://127.0.0.1:9\n\tstore: sqlite:///x.db\n",
        "line 2, column 1: found character '\\t' that cannot start any token "
        "(while scanning for the next token)",
    ),
    "bad indentation": (
        "upstream: http://127.0.0.1:9\nowner:\n  strategy: none\n required: true\n",
        "line 4, column 2: expected <block end>, but found '<block mapping start>' "
        "(while parsing a block mapping at line 1, column 1)",
    ),
}


@pytest.mark.parametrize("case", BROKEN_YAML)
def test_a_yaml_syntax_error_is_one_line_naming_file_line_and_column(
    tmp_path: Path, run_cli: RunCli, case: str
) -> None:
    text, where = BROKEN_YAML[case]
    config = tmp_path / "idemproxy.yaml"
    config.write_text(text)
    # Every command that reads the file says the same; one case is enough for the others.
    commands = (
        [["serve"], ["migrate"], ["jobs", "list"]] if case == "tab indentation" else [["serve"]]
    )
    for command in commands:
        done = run_cli(*command, "--config", str(config), timeout=20)
        assert done.returncode == 2, (command, done)
        expected = f"idemproxy: invalid configuration: config: {config}, {where}"
        assert done.stderr.strip().splitlines() == [expected], done.stderr


def test_a_config_file_that_is_not_a_mapping_or_not_text_is_one_line(
    tmp_path: Path, run_cli: RunCli
) -> None:
    listed = tmp_path / "list.yaml"
    listed.write_text("- upstream: http://127.0.0.1:9\n")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00u")
    for path, message in [
        (listed, f"config: {listed} must be a YAML mapping of settings"),
        (binary, f"config: cannot read {binary}: not UTF-8 text (byte 0)"),
    ]:
        done = run_cli("serve", "--config", str(path), timeout=20)
        assert done.returncode == 2, done
        assert done.stderr.strip().splitlines() == [f"idemproxy: invalid configuration: {message}"]


BAD_DSNS = {
    "port not a number": (
        "postgresql://app:{secret}@127.0.0.1:notaport/idem?password={secret}",
        "store: the PostgreSQL DSN cannot be parsed (check its hosts, ports and parameters)",
    ),
    "unknown sslmode": (
        "postgresql://app:{secret}@127.0.0.1:9/idem?password={secret}&sslmode=sometimes",
        "store: `sslmode` parameter must be one of: disable, allow, prefer, require, "
        "verify-ca, verify-full",
    ),
}


@pytest.mark.parametrize("case", BAD_DSNS)
def test_a_dsn_the_driver_cannot_use_is_one_line_without_its_secret(
    run_cli: RunCli, case: str
) -> None:
    template, message = BAD_DSNS[case]
    dsn = template.format(secret=SECRETS[0])
    serve = ["serve", "--upstream", "http://127.0.0.1:9", "--listen", f"127.0.0.1:{free_port()}"]
    for command in (["migrate"], serve):
        done = run_cli(*command, "--store", dsn, timeout=20)
        assert done.returncode == 2, (command, done)
        assert SECRETS[0] not in done.stdout + done.stderr
        lines = done.stderr.strip().splitlines()
        assert lines[-1] == f"idemproxy: invalid configuration: {message}", done.stderr
        assert "Traceback" not in done.stderr


BAD_URLS = {
    # Accepted before: every request then failed with a 500 and a traceback (upstream), or the
    # start with a traceback (redis).
    "upstream port": (
        ["--upstream", "http://app:{secret}@127.0.0.1:notaport"],
        "upstream: Value error, the port (or an IPv6 address in brackets) is malformed",
    ),
    "upstream host": (["--upstream", "http://:8000"], "upstream: Value error, names no host"),
    "redis port": (
        ["--upstream", "http://127.0.0.1:9", "--redis", "redis://:{secret}@127.0.0.1:nope/0"],
        "redis.url: Value error, the port (or an IPv6 address in brackets) is malformed",
    ),
}


@pytest.mark.parametrize("case", BAD_URLS)
def test_a_malformed_upstream_or_redis_url_is_refused_at_start_up_without_its_secret(
    tmp_path: Path, run_cli: RunCli, case: str
) -> None:
    flags, message = BAD_URLS[case]
    args = [flag.format(secret=SECRETS[0]) for flag in flags]
    done = run_cli("serve", *args, "--store", f"sqlite:///{tmp_path}/x.db", timeout=20)
    assert done.returncode == 2, done
    assert done.stderr.strip().splitlines() == [f"idemproxy: invalid configuration: {message}"]
    assert SECRETS[0] not in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("owner", "hinted"), [(None, True), ("header:X-Tenant", False), ("none", False)]
)
async def test_the_default_owner_strategy_is_explained_once_at_start(
    tmp_path: Path, start_proxy: StartProxy, owner: str | None, hinted: bool
) -> None:
    store = f"sqlite:///{tmp_path / 'idemproxy.db'}"
    flags = ("--owner", owner) if owner else ()
    proxy = await start_proxy("--upstream", "http://127.0.0.1:9", "--store", store, *flags)
    await _logged(proxy, "listening on")
    assert await proxy.terminate() == 0, proxy.describe()
    hint = "owner.strategy is authorization: jobs are scoped by a hash of the whole Authorization"
    assert proxy.stderr().count(hint) == (1 if hinted else 0), proxy.describe()
    if hinted:
        assert "use owner.strategy jwt or header:<NAME> set by a gateway" in proxy.stderr()
        # SPEC §5: and what it means for clients that sign every request.
        assert "AWS SigV4" in proxy.stderr() and "400 owner-unstable" in proxy.stderr()


def test_tls_on_an_http_upstream_stops_the_start(tmp_path: Path, run_cli: RunCli) -> None:
    """SPEC §10: a CA or a client certificate on an http:// upstream would never apply: the
    request would go in plaintext while the operator believes it verified."""
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    config = tmp_path / "idemproxy.yaml"
    config.write_text(
        "routes: [{prefix: /, upstream: 'http://127.0.0.1:9'}]\n"
        f"upstreams: {{'http://127.0.0.1:9': {{tls: {{ca_file: '{ca}'}}}}}}\n"
    )
    store = f"sqlite:///{tmp_path}/x.db"
    done = run_cli("serve", "--config", str(config), "--store", store, timeout=20)
    assert done.returncode == 2, done
    assert done.stderr.strip().splitlines() == [
        "idemproxy: invalid configuration: upstreams: Value error, http://127.0.0.1:9: tls is"
        " set but the upstream is http://, where it never applies: make it https:// or remove tls"
    ]


async def test_an_identity_provider_not_verified_is_warned_at_start(
    tmp_path: Path, start_proxy: StartProxy
) -> None:
    """SPEC §5: the provider's keys decide every owner; `idp.tls.verify: false` is warned as an
    upstream's is."""
    jwks_uri = f"https://127.0.0.1:{free_port()}/jwks.json"  # down: the start goes on regardless
    env = {
        "IDEMPROXY_OWNER__STRATEGY": "jwt",
        "IDEMPROXY_OWNER__JWT__JWKS_URI": jwks_uri,
        "IDEMPROXY_OWNER__JWT__ALGORITHMS": "RS256",
        "IDEMPROXY_OWNER__JWT__AUDIENCE": "api",
        "IDEMPROXY_OWNER__JWT__IDP__TLS__VERIFY": "false",
    }
    store = f"sqlite:///{tmp_path / 'idemproxy.db'}"
    proxy = await start_proxy("--upstream", "http://127.0.0.1:9", "--store", store, env=env)
    await _logged(proxy, "listening on")
    assert await proxy.terminate() == 0, proxy.describe()
    warning = (
        f"owner.jwt.idp {jwks_uri}: TLS certificates are not verified (its tls.verify is false):"
        " anyone on the path can serve the keys that decide every owner"
    )
    assert proxy.stderr().count(warning) == 1, proxy.describe()
