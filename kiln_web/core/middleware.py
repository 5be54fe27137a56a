"""Every /v1/ error in the API's one shape: Django answers a path no route has with an HTML 404 and django-ninja
a method an operation does not take with a plain-text 405, before any of Kiln's handlers can; this middleware
turns any /v1/ error response that is not JSON into {"error": {"code", "message"}}."""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponse

from kiln_web.core.http import HTTP_CODES, error_response

API_PREFIX = "/v1/"
KEPT_HEADERS = ("Allow", "Vary")


def _message(request: HttpRequest, response: HttpResponse) -> str:
    if response.status_code == 404:
        return f"no API endpoint at {request.path}; /v1/docs lists them (with a token)"
    if response.status_code == 405:
        return f"{request.method} is not allowed on {request.path}; use {response.get('Allow') or 'another method'}"
    if response.status_code >= 500:
        return "the server failed on this request; its log has the details"
    return response.reason_phrase


def coded(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    """RESPONSE, or, for a /v1/ error that is not JSON, the coded error it means (its Allow, Vary and cookies kept)."""
    if (response.status_code < 400 or not (request.path + "/").startswith(API_PREFIX)
            or response.get("Content-Type", "").startswith("application/json")):
        return response
    error = error_response(response.status_code, HTTP_CODES.get(response.status_code, "error"),
                           _message(request, response))
    for header in KEPT_HEADERS:
        if header in response:
            error[header] = response[header]
    error.cookies = response.cookies
    return error


class CodedApiErrors:
    """Sync and async alike (no thread hop for the async serving views): `coded` on every response."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest):
        if self.is_async:
            return self._acall(request)
        return coded(request, self.get_response(request))

    async def _acall(self, request: HttpRequest):
        return coded(request, await self.get_response(request))
