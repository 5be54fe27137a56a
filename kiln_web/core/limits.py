"""Request bodies bounded before Django reads them: Django's ASGI handler spools a whole body to disk before any
view (or DATA_UPLOAD_MAX_MEMORY_SIZE) can refuse it, so `kiln up` without a proxy in front would accept a body
of any size. This ASGI wrapper answers 413 as soon as a body is known to be too large.

/v1/ bodies are JSON and may be KILN_UPLOAD_MAX_BYTES long; the dashboard's multipart forms get
FORM_OVERHEAD_BYTES more, so that a file just over the limit reaches the form, which says what to do.
"""

from __future__ import annotations

import json

from django.conf import settings

FORM_OVERHEAD_BYTES = 1 << 20  # multipart framing and the form's other fields beside an upload


class BodyLimit:
    def __init__(self, app):
        self.app = app

    def limit(self, path: str) -> int:
        extra = 0 if path.startswith("/v1/") else FORM_OVERHEAD_BYTES
        return settings.KILN_UPLOAD_MAX_BYTES + extra

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit(scope.get("path", ""))
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None:
            try:
                too_large = int(declared) > limit
            except ValueError:
                too_large = False  # the server refuses a malformed length itself
            if too_large:
                return await _refuse(send, scope, limit)
            return await self.app(scope, receive, send)

        # no declared length (chunked): count, and stop reading once past the limit
        state = {"received": 0, "exceeded": False, "started": False}

        async def counted_receive():
            if state["exceeded"]:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > limit:
                    state["exceeded"] = True
                    return {"type": "http.disconnect"}  # Django stops reading (RequestAborted)
            return message

        async def tracked_send(message):
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        await self.app(scope, counted_receive, tracked_send)
        if state["exceeded"] and not state["started"]:
            await _refuse(send, scope, limit)


async def _refuse(send, scope, limit: int) -> None:
    """413: the API's error shape under /v1/, a sentence for a person elsewhere."""
    message = (f"The request body is larger than {limit} bytes (KILN_UPLOAD_MAX_BYTES); put the dataset in a "
               "data root and give its path (dataset_path) instead.")
    if scope.get("path", "").startswith("/v1/"):
        kind = b"application/json"
        body = json.dumps({"error": {"code": "request_too_large", "message": message}}).encode()
    else:
        body, kind = message.encode() + b"\n", b"text/plain; charset=utf-8"
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", kind), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
