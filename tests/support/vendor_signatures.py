"""Cloud vendors' request signatures, built as their documentation says (SPEC §5 tests).

Each takes the time the client signs at (`when`, seconds since the epoch): a retry signed a
second later is another credential. QBox signs the path and the body only, so it changes with
the request, not the clock."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Callable
from email.utils import formatdate
from urllib.parse import quote

_AK, _SK = "AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
Signer = Callable[[str, str, str, float], dict[str, str]]


def _hex_mac(key: bytes, data: str, digest: str = "sha256") -> str:
    return hmac.new(key, data.encode(), digest).hexdigest()


def _b64_mac(key: bytes, data: str, digest: str, *, urlsafe: bool = False) -> str:
    mac = hmac.digest(key, data.encode(), digest)
    return (base64.urlsafe_b64encode if urlsafe else base64.b64encode)(mac).decode()


def tencent_cos(method: str, host: str, path: str, when: float) -> dict[str, str]:
    """Tencent COS's `q-sign-algorithm=sha1&…&q-signature=…` (no scheme before it)."""
    window = f"{int(when)};{int(when) + 600}"
    sign_key = _hex_mac(_SK.encode(), window, "sha1")
    http = f"{method.lower()}\n{path}\n\nhost={host}\n"
    to_sign = f"sha1\n{window}\n{hashlib.sha1(http.encode()).hexdigest()}\n"
    signature = _hex_mac(sign_key.encode(), to_sign, "sha1")
    return {
        "Authorization": f"q-sign-algorithm=sha1&q-ak={_AK}&q-sign-time={window}"
        f"&q-key-time={window}&q-header-list=host&q-url-param-list=&q-signature={signature}"
    }


def azure_hmac(method: str, host: str, path: str, when: float) -> dict[str, str]:
    """Azure's HMAC-SHA256 (App Configuration, Communication Services): `&` between
    parameters, over `x-ms-date`, the host and the body's hash."""
    date = formatdate(when, usegmt=True)
    content = base64.b64encode(hashlib.sha256(b"").digest()).decode()
    to_sign = f"{method}\n{path}\n{date};{host};{content}"
    signature = _b64_mac(_SK.encode(), to_sign, "sha256")
    return {
        "x-ms-date": date,
        "x-ms-content-sha256": content,
        "Authorization": f"HMAC-SHA256 Credential={_AK}"
        f"&SignedHeaders=x-ms-date;host;x-ms-content-sha256&Signature={signature}",
    }


def baidu_bce(method: str, host: str, path: str, when: float) -> dict[str, str]:
    """Baidu Cloud's `bce-auth-v1/{ak}/{time}/{expiry}/{headers}/{signature}`."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))
    prefix = f"bce-auth-v1/{_AK}/{stamp}/1800"
    signing_key = _hex_mac(_SK.encode(), prefix)
    signature = _hex_mac(signing_key.encode(), f"{method}\n{path}\n\nhost:{host}")
    return {"Authorization": f"{prefix}/host/{signature}"}


def goog1(method: str, host: str, path: str, when: float) -> dict[str, str]:
    """Google Cloud Storage's HMAC (interoperability) signature, SigV2's form over `Date`."""
    date = formatdate(when, usegmt=True)
    signature = _b64_mac(_SK.encode(), f"{method}\n\n\n{date}\n{path}", "sha1")
    return {"Date": date, "Authorization": f"GOOG1 {_AK}:{signature}"}


def qiniu(method: str, host: str, path: str, when: float) -> dict[str, str]:
    """Qiniu's signature over the request line, `Host` and `X-Qiniu-Date`."""
    date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when))
    data = f"{method} {path}\nHost: {host}\nX-Qiniu-Date: {date}\n\n"
    signature = _b64_mac(_SK.encode(), data, "sha1", urlsafe=True)
    return {"X-Qiniu-Date": date, "Authorization": f"Qiniu {_AK}:{signature}"}


def qbox(path: str, body: bytes) -> dict[str, str]:
    """Qiniu's older QBox signature: the path and a form body, no time."""
    data = f"{path}\n{body.decode()}"
    return {"Authorization": f"QBox {_AK}:{_b64_mac(_SK.encode(), data, 'sha1', urlsafe=True)}"}


def cosmos_master(method: str, host: str, path: str, when: float) -> dict[str, str]:
    """Azure Cosmos DB's master key token, URL-encoded as its documentation requires: over
    the verb, resource type and link, and `x-ms-date`, lower-cased."""
    date = formatdate(when, usegmt=True)
    to_sign = f"{method.lower()}\ndocs\n{path.strip('/')}\n{date.lower()}\n\n"
    key = base64.b64encode(_SK.encode())
    signature = _b64_mac(base64.b64decode(key), to_sign, "sha256")
    token = quote(f"type=master&ver=1.0&sig={signature}", safe="")
    return {"x-ms-date": date, "Authorization": token}


def _sigv2_shape(scheme: str, method: str, path: str, when: float) -> dict[str, str]:
    """`<scheme> <id>:<HMAC-SHA1 over the verb, Content-MD5, Content-Type, Date, the path>`:
    Huawei OBS, Alibaba Cloud ROA (`acs`), Vuforia (`VWS`), as each documents it."""
    date = formatdate(when, usegmt=True)
    signature = _b64_mac(_SK.encode(), f"{method}\n\n\n{date}\n{path}", "sha1")
    return {"Date": date, "Authorization": f"{scheme} {_AK}:{signature}"}


def huawei_obs(method: str, host: str, path: str, when: float) -> dict[str, str]:
    return _sigv2_shape("OBS", method, path, when)


def alibaba_roa(method: str, host: str, path: str, when: float) -> dict[str, str]:
    return _sigv2_shape("acs", method, path, when)


def vuforia(method: str, host: str, path: str, when: float) -> dict[str, str]:
    return _sigv2_shape("VWS", method, path, when)


def upyun(method: str, host: str, path: str, when: float) -> dict[str, str]:
    """UPYUN's `UPYUN <operator>:<HMAC-SHA1 keyed by md5(password), over method&uri&date>`."""
    date = formatdate(when, usegmt=True)
    key = hashlib.md5(_SK.encode()).hexdigest().encode()
    signature = _b64_mac(key, f"{method}&{path}&{date}", "sha1")
    return {"Date": date, "Authorization": f"UPYUN operator:{signature}"}


def api_auth(method: str, host: str, path: str, when: float) -> dict[str, str]:
    """Ruby api-auth's `APIAuth <access id>:<HMAC over method,type,md5,path,date>`."""
    date = formatdate(when, usegmt=True)
    signature = _b64_mac(_SK.encode(), f"{method},,,{path},{date}", "sha1")
    return {"Date": date, "Authorization": f"APIAuth {_AK}:{signature}"}


SIGNERS: dict[str, Signer] = {
    "tencent-cos": tencent_cos,
    "azure-hmac": azure_hmac,
    "baidu-bce": baidu_bce,
    "goog1": goog1,
    "qiniu": qiniu,
    "cosmos-master": cosmos_master,
    "huawei-obs": huawei_obs,
    "alibaba-roa": alibaba_roa,
    "upyun": upyun,
    "vuforia": vuforia,
    "api-auth": api_auth,
}


# Static credentials that hold a signature or a time, each sent unchanged on every try (both
# tests/unit/test_signed.py and tests/proxy/test_signed_owner.py).
STABLE_SIGNED_LOOKING = [
    # Azure Service Bus, Event Hubs and IoT Hub SAS tokens: reused until `se`.
    "SharedAccessSignature sr=acme.servicebus.windows.net%2forders&sig=c2ln%2Bbg%3D"
    "&se=1796533200&skn=RootManageSharedAccessKey",
    "SharedAccessSignature sr=https%3A%2F%2Facme.servicebus.windows.net%2Fhub&sig=c2ln"
    "&se=1796533200&skn=send",
    "SharedAccessSignature sr=acme.azure-devices.net%2Fdevices%2Fd1&sig=c2ln&se=1796533200",
    # Azure Cosmos DB resource and Entra ID tokens, plain and URL-encoded.
    "type=aad&ver=1.0&sig=eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJhIn0.c2ln",
    "type=resource&ver=1.0&sig=c2lnbmF0dXJl",
    "type%3Daad%26ver%3D1.0%26sig%3DeyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJhIn0.c2ln",
    "ver=1.0&sig=c2lnbmF0dXJl&type=resource",
    # API keys that hold a time: no MAC, no nonce, no signing scheme.
    "MyKey k=abc&date=2026",
    "abc&time=1",
    "Custom id=a&ts=1796533200",
    "Custom id=a, X-Date=20261206T050000Z",
]
