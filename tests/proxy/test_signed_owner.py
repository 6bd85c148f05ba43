"""SPEC §5: with the default owner (a hash of the whole Authorization), a credential signed for
each request put every try in a scope of its own. A keyed S3 CreateMultipartUpload signed with
SigV4 and retried 1.2 s later, signed again, executed twice with no replay header. Such a
governed request is now refused before anything is claimed (400 owner-unstable); the owner
settings it names scope it by something that stays the same, and requests the proxy does not
govern still pass untouched."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlsplit

import pytest
from botocore.auth import S3SigV4QueryAuth, SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from tests.support.backend import Ledger
from tests.support.proxyapp import ProxyClient
from tests.support.proxychecks import KEY, REPLAYED, assert_problem
from tests.support.signatures import digest_authorization, hawk_authorization, message_signature
from tests.support.vendor_signatures import SIGNERS, STABLE_SIGNED_LOOKING, qbox

from .conftest import ProxyFactory

UPLOAD = "/bucket/video.mp4?uploads"
CREDENTIALS = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")


def sigv4(client: ProxyClient, path_qs: str, method: str = "POST") -> dict[str, str]:
    """The headers botocore signs the request with, now (X-Amz-Date to the second)."""
    request = AWSRequest(method=method, url=str(client.make_url(path_qs)), data=b"")
    SigV4Auth(CREDENTIALS, "s3", "us-east-1").add_auth(request)
    return dict(request.headers.items())


def presigned(client: ProxyClient, path: str) -> str:
    """The path and query of a URL botocore presigns (its credential is in the query)."""
    request = AWSRequest(method="POST", url=str(client.make_url(path)), data=b"")
    S3SigV4QueryAuth(CREDENTIALS, "s3", "us-east-1", expires=300).add_auth(request)
    url = urlsplit(request.url or "")
    return f"{url.path}?{url.query}"


async def send(
    client: ProxyClient, path_qs: str, headers: dict[str, str], method: str = "POST"
) -> tuple[int, bool, dict[str, Any]]:
    async with client.request(method, path_qs, headers=headers, data=b"") as response:
        body = await response.read()
        problem = json.loads(body) if response.headers.get("Idempotency-Error") else {}
        return response.status, REPLAYED in response.headers, problem


async def test_a_sigv4_request_retried_signed_again_is_refused_not_run_twice(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    client = await proxy()
    first = {**sigv4(client, UPLOAD), KEY: "upload-1"}
    await asyncio.sleep(1.2)  # the client's retry, signed again a second later
    retry = {**sigv4(client, UPLOAD), KEY: "upload-1"}
    assert first["Authorization"] != retry["Authorization"]  # a new owner, by the old rule
    for headers in (first, retry):
        async with client.post(UPLOAD, headers=headers, data=b"") as response:
            problem = await assert_problem(
                response, "owner-unstable", 400, retry="new-key-safe", job_state="none"
            )
        assert "AWS Signature Version 4" in problem["detail"]
        assert "header:<NAME>" in problem["detail"] and "AKIDEXAMPLE" not in problem["detail"]
    assert ledger.count() == 0


async def test_each_per_request_credential_is_refused_before_anything_is_claimed(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    client = await proxy()
    cases = {
        "digest": {"Authorization": digest_authorization("POST", "/orders")},
        "hawk": {"Authorization": hawk_authorization("POST", "/orders")},
        "rfc9421": message_signature("POST", f"127.0.0.1:{client.port}", "/orders"),
    }
    for name, headers in cases.items():
        status, _, problem = await send(client, "/orders", {**headers, KEY: f"k-{name}"})
        assert (status, problem["code"]) == (400, "owner-unstable"), name
    status, _, problem = await send(client, presigned(client, "/bucket/a"), {KEY: "k-presigned"})
    assert (status, problem["code"]) == (400, "owner-unstable")
    assert "presigned URL" in problem["detail"]
    assert ledger.count() == 0


async def test_requests_the_proxy_does_not_govern_pass_untouched(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    client = await proxy()
    keyless = sigv4(client, UPLOAD)
    assert (await send(client, UPLOAD, keyless))[0] == 201
    signed_get = {**sigv4(client, "/bucket/video.mp4", "GET"), KEY: "ignored-on-get"}
    assert (await send(client, "/bucket/video.mp4", signed_get, "GET"))[0] == 201
    assert [e.header("Authorization") for e in ledger.executions] == [
        keyless["Authorization"],
        signed_get["Authorization"],
    ]


async def test_a_gateway_header_scopes_the_signed_retries_and_the_retry_replays(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    """What the problem names works: a gateway that verified the signature says who signed."""
    client = await proxy(owner={"strategy": "header:X-Tenant"})
    first = {**sigv4(client, UPLOAD), KEY: "upload-2", "X-Tenant": "acme"}
    assert await send(client, UPLOAD, first) == (201, False, {})
    await asyncio.sleep(1.2)
    retry = {**sigv4(client, UPLOAD), KEY: "upload-2", "X-Tenant": "acme"}
    assert await send(client, UPLOAD, retry) == (201, True, {})
    assert ledger.count("upload-2") == 1


async def test_a_body_keyed_route_refuses_only_a_request_its_body_gives_a_key(
    proxy: ProxyFactory, backend_url: str, ledger: Ledger
) -> None:
    """SPEC §4.1: the owner is read before the body there; a body without a key still passes."""
    key = {"pointer": "/order_id"}
    client = await proxy(routes=[{"prefix": "/orders", "upstream": backend_url, "key": key}])
    signed = {"Authorization": digest_authorization("POST", "/orders")}
    async with client.post("/orders", json={"amount": 1}, headers=signed) as response:
        assert response.status == 201
    async with client.post("/orders", json={"order_id": "o-1"}, headers=signed) as response:
        await assert_problem(response, "owner-unstable", 400, job_state="none")
    assert ledger.count() == 1


async def test_a_status_lookup_is_refused_as_its_request_would_be(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    """SPEC §7.1: the lookup derives the owner as a governed request does; under a signature
    it could never find the job, so it says why instead of 404."""
    client = await proxy(status_header="Idempotency-Status")
    headers = {**sigv4(client, "/bucket/video.mp4", "GET"), "Idempotency-Status": "upload-1"}
    async with client.get("/bucket/video.mp4", headers=headers) as response:
        await assert_problem(response, "owner-unstable", 400)
    assert ledger.count() == 0


@pytest.mark.parametrize("vendor", SIGNERS)
async def test_a_vendor_signature_signed_again_a_second_later_is_refused(
    proxy: ProxyFactory, ledger: Ledger, vendor: str
) -> None:
    """Tencent COS, Azure's HMAC-SHA256, Baidu's bce-auth-v1, GOOG1, Qiniu, a Cosmos DB master
    key token (URL-encoded), Huawei OBS, Alibaba ROA (`acs`), UPYUN, Vuforia (`VWS`) and ruby
    api-auth (`APIAuth`): each try, signed again, was an owner of its own and the retry
    executed again."""
    client = await proxy()
    sign, now = SIGNERS[vendor], time.time()
    tries = [sign("POST", f"127.0.0.1:{client.port}", "/orders", now + s) for s in (0, 1)]
    assert tries[0]["Authorization"] != tries[1]["Authorization"]
    answers = [await send(client, "/orders", {**t, KEY: f"k-{vendor}"}) for t in tries]
    assert [(status, problem.get("code")) for status, _, problem in answers] == [
        (400, "owner-unstable"),
        (400, "owner-unstable"),
    ]
    assert ledger.count() == 0


async def test_sigv4_with_a_tab_after_its_scheme_is_refused(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    """SigV4 as some signers lay it out: a tab after the scheme, no space after the commas;
    there was no space to find the scheme by, and each try was an owner of its own."""
    client = await proxy()
    tries = []
    for _ in range(2):
        headers = sigv4(client, UPLOAD)
        headers["Authorization"] = headers["Authorization"].replace(", ", ",").replace(" ", "\t", 1)
        tries.append({**headers, KEY: "upload-tab"})
        await asyncio.sleep(1.1)  # X-Amz-Date is to the second
    answers = [await send(client, UPLOAD, headers) for headers in tries]
    assert [(status, problem.get("code")) for status, _, problem in answers] == [
        (400, "owner-unstable"),
        (400, "owner-unstable"),
    ]
    assert "AWS Signature Version 4" in answers[0][2]["detail"]
    assert ledger.count() == 0


async def test_a_qbox_signature_is_refused_though_it_signs_no_time(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    """QBox signs the path and the body: the same key sent with another body (which must be
    409 payload-mismatch) was another owner, and executed again."""
    client = await proxy()
    for body in (b"amount=1", b"amount=2"):
        headers = {**qbox("/orders", body), KEY: "k-qbox"}
        async with client.post("/orders", headers=headers, data=body) as response:
            await assert_problem(response, "owner-unstable", 400, job_state="none")
    assert ledger.count() == 0


async def test_credentials_sent_the_same_on_every_try_still_replay(
    proxy: ProxyFactory, ledger: Ledger
) -> None:
    """The wider detection leaves static credentials alone: each retry is replayed. Azure SAS
    tokens (`sig` and `se`), Cosmos DB resource and Entra ID tokens, and API keys holding a
    `date` or `ts` were refused 400 owner-unstable, though each try sends them unchanged."""
    client = await proxy()
    stable = [
        "Bearer sk-live-4f9a1c2e7b",
        "Basic dXNlcjpwYXNz",
        "Token abc123",
        "ApiKey key=abc",
        "DPoP eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJhIn0.c2ln",
        "sk-live-without-a-scheme",
        "Custom key=abc&tenant=42",
        *STABLE_SIGNED_LOOKING,
    ]
    for n, authorization in enumerate(stable):
        headers = {"Authorization": authorization, KEY: f"k-stable-{n}"}
        assert await send(client, "/orders", headers) == (201, False, {})
        assert await send(client, "/orders", headers) == (201, True, {}), authorization
        assert ledger.count(f"k-stable-{n}") == 1
