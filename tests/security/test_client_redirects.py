"""The `kiln` CLI's API client never follows a redirect: following one would send the bearer token to whatever
address the answer names (urllib copies the Authorization header to another host), and would turn a POST into a
GET. It stops with `redirected`, naming the address, so the person can point KILN_URL at it if they trust it."""

import http.server
import threading

import pytest

from kiln_web.client import ApiError, Client


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list = []

    def _answer(self):
        type(self).seen.append((self.command, self.path, self.headers.get("Authorization")))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


def _serve(handler) -> http.server.HTTPServer:
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def servers():
    recorder = type("Recorder", (_Recorder,), {"seen": []})
    other = _serve(recorder)

    class Redirector(http.server.BaseHTTPRequestHandler):
        status = 302

        def _answer(self):
            self.send_response(type(self).status)
            self.send_header("Location", f"http://127.0.0.1:{other.server_port}/elsewhere")
            self.end_headers()

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    kiln = _serve(Redirector)
    yield kiln, Redirector, recorder
    for server in (kiln, other):
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("method", ["GET", "POST"])
def test_a_redirect_is_not_followed_and_the_token_goes_nowhere_else(servers, status, method):
    kiln, redirector, recorder = servers
    redirector.status = status
    client = Client(f"http://127.0.0.1:{kiln.server_port}", "kiln_secret-token")
    with pytest.raises(ApiError) as refused:
        client.request(method, "/train/jobs", {} if method == "POST" else None)
    assert recorder.seen == []
    assert refused.value.code == "redirected" and refused.value.status == status
    assert f"http://127.0.0.1:{kiln.server_port}/v1/train/jobs" in refused.value.message
    assert "/elsewhere" in refused.value.message and "KILN_URL" in refused.value.message
