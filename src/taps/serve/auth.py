"""The API key of `taps serve`: OpenAI-style `Authorization: Bearer KEY` on every endpoint but
/health, checked in constant time."""

from __future__ import annotations

import hashlib
import hmac
import json

from taps.serve.protocol import RequestError


class BearerKey:
    """ASGI middleware: every request but GET /health needs `Authorization: Bearer KEY`; the key is
    compared as a SHA-256 digest (same length whatever is sent) with hmac.compare_digest."""

    def __init__(self, app, key: str, rejected=lambda status: None):
        self.app, self.rejected = app, rejected
        self.digest = hashlib.sha256(key.encode()).digest()

    def allowed(self, scope) -> bool:
        header = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        same = hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self.digest)
        return same and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health" or self.allowed(scope):
            return await self.app(scope, receive, send)
        self.rejected(401)
        body = json.dumps(RequestError("a valid API key is needed: send it as Authorization: Bearer KEY",
                                       kind="invalid_request_error", code="invalid_api_key").body()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
