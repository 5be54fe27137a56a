"""One HTTP request through an ASGI application in this process, as `kiln up` would pass it on."""

from asgiref.testing import ApplicationCommunicator


async def asgi_request(app, method: str, path: str, headers=(), query: bytes = b"", timeout: float = 20):
    """(status, sorted response headers, body) of METHOD PATH with HEADERS (name, value bytes pairs)."""
    scope = {"type": "http", "http_version": "1.1", "method": method, "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": query, "headers": [(b"host", b"localhost"), *headers],
             "client": ("127.0.0.1", 1), "server": ("localhost", 80)}
    communicator = ApplicationCommunicator(app, scope)
    await communicator.send_input({"type": "http.request", "body": b""})
    start = await communicator.receive_output(timeout)
    body = b""
    while True:
        message = await communicator.receive_output(timeout)
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await communicator.wait(timeout)
    return start["status"], sorted(start["headers"]), body
