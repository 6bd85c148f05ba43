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


SIGNERS: dict[str, Signer] = {
    "tencent-cos": tencent_cos,
    "azure-hmac": azure_hmac,
    "baidu-bce": baidu_bce,
    "goog1": goog1,
    "qiniu": qiniu,
}
