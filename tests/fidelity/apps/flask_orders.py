"""A Flask app served by gunicorn: `POST /orders` answers 201 with `Location` from
`url_for(..., _external=True)` (the request's Host), `GET /orders/<key>` a self link."""

from __future__ import annotations

import os

from flask import Flask, Response, jsonify, request, url_for

app = Flask(__name__)
LEDGER = os.environ["LEDGER"]


@app.post("/orders")
def create_order() -> tuple[Response, int, dict[str, str]]:
    key = request.headers.get("Idempotency-Key", "")
    with open(LEDGER, "a", encoding="utf-8") as ledger:
        ledger.write(key + "\n")
    url = url_for("order", key=key, _external=True)
    body = request.get_json(force=True)
    return jsonify(id=key, amount=body["amount"], url=url), 201, {"Location": url}


@app.get("/orders/<key>")
def order(key: str) -> Response:
    return jsonify(id=key, url=url_for("order", key=key, _external=True))
