"""`POST /orders` creates an order named by its Idempotency-Key: 201, its absolute URL in
`Location` (`build_absolute_uri`, from the request's Host); `GET /orders/<key>` shows one."""

from __future__ import annotations

import json

from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST


@csrf_exempt  # an API called with a key, not a form: no CSRF cookie
@require_POST
def create_order(request: HttpRequest) -> JsonResponse:
    key = request.headers.get("Idempotency-Key", "")
    with open(settings.LEDGER, "a", encoding="utf-8") as ledger:
        ledger.write(key + "\n")
    url = request.build_absolute_uri(f"/orders/{key}")
    order = {"id": key, "amount": json.loads(request.body)["amount"], "url": url}
    response = JsonResponse(order, status=201)
    response["Location"] = url
    return response


@require_GET
def order(request: HttpRequest, key: str) -> JsonResponse:
    return JsonResponse({"id": key, "url": request.build_absolute_uri()})
