"""An S3-compatible server (moto's standalone server, signatures checked) driven by boto3,
directly and through the proxy, with object keys S3 allows and path-minded proxies refuse.

Every boto3 request is signed (AWS Signature Version 4) over its Host and its exact target, so
the server answers `403 SignatureDoesNotMatch` to a request whose Host or target changed on the
way. `Idempotency-Key` is added before signing, so the signature covers it too: the proxy must
pass it on byte for byte (SPEC §10), and the headers it adds (`Idempotency-Job`,
`X-Forwarded-*`) are not signed and do not disturb the check. A signature is a credential made
anew for each request, so the proxy derives no owner from it: it runs with `owner: none` (one
tenant), and the default `authorization` owner refuses such requests (SPEC §5).

boto3 parses answers, so a `Tap` in front of each endpoint keeps the bytes that were answered.
Executions are counted in the server itself: its multipart uploads for the key.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import botocore.config
import pytest
from botocore.exceptions import ClientError

from tests.fidelity.compare import Volatile, assert_replay_of, assert_same_as_server
from tests.fidelity.servers import Running, proxy, serving
from tests.fidelity.wire import Answer, Tap, tapped

KEYS = ["plain.txt", "a;b.txt", "logs//2026.txt", "x/../y.txt", "./rel.txt", "my file /z.txt"]
REGION = "us-east-1"
# moto checks signatures once this many requests have set it up (a user, its policy, its key).
SETUP_REQUESTS = 3
ALLOW_ALL = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
}
_CONFIG = botocore.config.Config(
    s3={"addressing_style": "path"},
    retries={"total_max_attempts": 1},  # one request per call: one answer for the tap
)

# What the server makes anew for every request it executes (the twins answer the same request
# with different values), never different between a first answer and its replay.
REQUEST_ID = Volatile(b"x-amz-request-id", None, "the server's id of each request it handles")
REQUEST_ID2 = Volatile(b"x-amzn-requestid", None, "the same id under its other name")
EXTENDED_ID = Volatile(b"x-amz-id-2", None, "the server's extended request id")
UPLOAD_ID = Volatile(None, re.compile(rb"<UploadId>([^<]*)</UploadId>"), "random per upload")
MODIFIED = Volatile(b"last-modified", None, "when each twin stored the object")
LISTED_MODIFIED = Volatile(
    None, re.compile(rb"<LastModified>([^<]*)</LastModified>"), "when each twin stored it"
)
PER_REQUEST = (REQUEST_ID, REQUEST_ID2, EXTENDED_ID)


@dataclass
class S3Server:
    running: Running
    credentials: dict[str, str]
    admin: Any = None  # a client at the server itself, not through a tap

    def client(self, port: int) -> Any:
        """A boto3 S3 client at `port` (a tap, the proxy); the caller closes it."""
        return boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{port}",
            region_name=REGION,
            config=_CONFIG,
            **self.credentials,
        )

    def uploads(self, bucket: str, key: str) -> int:
        """Multipart uploads the server started for `key`: the executions of that intent."""
        listed = self.admin.list_multipart_uploads(Bucket=bucket, Prefix=key)
        return sum(1 for upload in listed.get("Uploads", []) if upload["Key"] == key)


@contextlib.contextmanager
def _moto(name: str, logs: Path) -> Iterator[S3Server]:
    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]

    env = {"INITIAL_NO_AUTH_ACTION_COUNT": str(SETUP_REQUESTS)}
    with serving(name, command, logs, env=env) as running:
        iam = boto3.client(
            "iam",
            endpoint_url=running.url,
            region_name=REGION,
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
        )
        iam.create_user(UserName="fidelity")
        iam.put_user_policy(
            UserName="fidelity", PolicyName="all", PolicyDocument=json.dumps(ALLOW_ALL)
        )
        made = iam.create_access_key(UserName="fidelity")["AccessKey"]
        iam.close()
        credentials = {
            "aws_access_key_id": made["AccessKeyId"],
            "aws_secret_access_key": made["SecretAccessKey"],
        }
        server = S3Server(running, credentials)
        server.admin = server.client(running.port)
        try:
            yield server
        finally:
            server.admin.close()


@dataclass
class Tapped:
    """A boto3 client whose every answer is also kept as bytes; `idempotency_key`, when set, is
    added to each request before it is signed."""

    client: Any
    tap: Tap
    idempotency_key: str | None = field(default=None)
    signed: list[str] = field(default_factory=list)  # SignedHeaders of each request sent

    def call(self, operation: str, method: str, **params: Any) -> tuple[Any, Answer]:
        try:
            result = getattr(self.client, operation)(**params)
        except ClientError as error:
            result = error.response
        if "Body" in result:
            result["Body"] = result["Body"].read()
        (answer,) = self.tap.answers([method])
        return result, answer

    def _add_key(self, request: Any, **_: Any) -> None:
        if self.idempotency_key is not None:
            request.headers["Idempotency-Key"] = self.idempotency_key

    def _record_signed(self, request: Any, **_: Any) -> None:
        authorization = request.headers["Authorization"].decode()
        self.signed.append(authorization.split("SignedHeaders=")[1].split(",")[0])


@contextlib.contextmanager
def _tapped_client(server: S3Server, port: int) -> Iterator[Tapped]:
    with tapped(port) as tap:
        tapped_client = Tapped(server.client(tap.port), tap)
        events = tapped_client.client.meta.events
        events.register("before-sign.s3", tapped_client._add_key)
        events.register("before-send.s3", tapped_client._record_signed)
        try:
            yield tapped_client
        finally:
            tapped_client.client.close()


@dataclass
class S3Twins:
    direct: S3Server
    behind: S3Server


@pytest.fixture(scope="module")
def s3(logs: Path) -> Iterator[S3Twins]:
    with _moto("s3-direct", logs) as direct, _moto("s3-behind", logs) as behind:
        yield S3Twins(direct, behind)


@pytest.fixture(scope="module")
def clients(s3: S3Twins, proxy_store: str, logs: Path) -> Iterator[tuple[Tapped, Tapped]]:
    """A client at the direct twin, and one at the proxy in front of the other twin."""
    with (
        proxy(s3.behind.running.url, proxy_store, logs, "--owner", "none") as front,
        _tapped_client(s3.direct, s3.direct.running.port) as direct,
        _tapped_client(s3.behind, front.port) as proxied,
    ):
        yield direct, proxied


def _both(
    clients: tuple[Tapped, Tapped], volatile: tuple[Volatile, ...], *, governed: bool = False
) -> Callable[..., Any]:
    def call(operation: str, method: str, **params: Any) -> Any:
        direct, proxied = clients
        _, server = direct.call(operation, method, **params)
        result, first = proxied.call(operation, method, **params)
        assert_same_as_server(server, first, volatile, governed=governed)
        return result

    return call


@pytest.mark.parametrize("name", KEYS)
def test_an_object_key_reaches_the_server_as_sent(
    s3: S3Twins, clients: tuple[Tapped, Tapped], key: str, name: str
) -> None:
    bucket = key  # a bucket per test: its listing holds this test's object only
    _both(clients, PER_REQUEST)("create_bucket", "PUT", Bucket=bucket)
    put = _both(clients, (*PER_REQUEST, MODIFIED))  # moto stamps a PUT answer too
    put("put_object", "PUT", Bucket=bucket, Key=name, Body=f"bytes of {name}".encode())
    got = _both(clients, (*PER_REQUEST, MODIFIED))("get_object", "GET", Bucket=bucket, Key=name)
    assert got["Body"] == f"bytes of {name}".encode()
    listed = _both(clients, (*PER_REQUEST, LISTED_MODIFIED))(
        "list_objects_v2", "GET", Bucket=bucket
    )
    assert [item["Key"] for item in listed["Contents"]] == [name]


@pytest.mark.parametrize("name", KEYS)
def test_a_multipart_upload_starts_once_and_is_replayed(
    s3: S3Twins, clients: tuple[Tapped, Tapped], key: str, name: str
) -> None:
    direct, proxied = clients
    bucket = key
    for client in (direct.client, s3.behind.admin):
        client.create_bucket(Bucket=bucket)
    direct.tap.answers(["PUT"])
    direct.idempotency_key = proxied.idempotency_key = key
    try:
        _, server = direct.call("create_multipart_upload", "POST", Bucket=bucket, Key=name)
        result, first = proxied.call("create_multipart_upload", "POST", Bucket=bucket, Key=name)
        assert_same_as_server(server, first, (*PER_REQUEST, UPLOAD_ID), governed=True)
        again, replay = proxied.call("create_multipart_upload", "POST", Bucket=bucket, Key=name)
    finally:
        direct.idempotency_key = proxied.idempotency_key = None
    assert_replay_of(first, replay)
    assert server.status == 200, server.describe()
    # The key was signed: the server checked that it arrived as the client sent it.
    assert "idempotency-key" in proxied.signed[-1].split(";")
    assert again["UploadId"] == result["UploadId"]
    assert s3.direct.uploads(bucket, name) == 1
    assert s3.behind.uploads(bucket, name) == 1


def test_the_default_owner_refuses_a_signed_request_and_runs_nothing(
    s3: S3Twins, proxy_store: str, logs: Path, key: str
) -> None:
    """A SigV4 `Authorization` is new on every request (it signs the time): as an owner it
    would put each retry in a scope of its own and execute it again, so the default owner
    refuses it with the proxy's own problem, before anything reaches the server (SPEC §5)."""
    bucket = key
    s3.behind.admin.create_bucket(Bucket=bucket)
    with (
        proxy(s3.behind.running.url, proxy_store, logs) as front,
        _tapped_client(s3.behind, front.port) as proxied,
    ):
        proxied.idempotency_key = key
        for _try in range(2):
            _, answer = proxied.call("create_multipart_upload", "POST", Bucket=bucket, Key="k")
            assert answer.status >= 400, answer.describe()
            assert len(answer.values("Idempotency-Error")) == 1, answer.describe()
    assert s3.behind.uploads(bucket, "k") == 0
