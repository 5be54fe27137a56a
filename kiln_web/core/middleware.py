"""Every /v1/ error in the API's one shape: Django answers a path no route has with an HTML 404 and django-ninja
a method an operation does not take with a plain-text 405, before any of Kiln's handlers can; this middleware
turns any /v1/ error response that is not JSON into {"error": {"code", "message"}}. It also refuses a /v1/ path
or query parameter holding a NUL character before any view looks it up: PostgreSQL refuses NUL in a query's
text, which would be a 500 (request bodies: kiln_web.core.http.json_body)."""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.core.exceptions import DisallowedHost
from django.http import HttpRequest, HttpResponse
from django.http.request import split_domain_port
from django.urls import Resolver404, resolve

from kiln_web.core.http import HTTP_CODES, NUL_TEXT, error_response

API_PREFIX = "/v1/"
KEPT_HEADERS = ("Allow", "Vary")


def _message(request: HttpRequest, response: HttpResponse) -> str:
    if response.status_code == 404:
        return f"no API endpoint at {request.path}; /v1/docs lists them (with a token)"
    if response.status_code == 405:
        return f"{request.method} is not allowed on {request.path}; use {response.get('Allow') or 'another method'}"
    if response.status_code >= 500:
        return "the server failed on this request; its log has the details"
    if response.status_code == 400:
        try:
            request.get_host()
        except DisallowedHost:  # Django's bare "Bad Request" for a Host header ALLOWED_HOSTS does not name
            host = request.META.get("HTTP_HOST", "")
            return (f"the host {host!r} is not in the server's ALLOWED_HOSTS; add {split_domain_port(host)[0]} to "
                    "ALLOWED_HOSTS (comma-separated) where Kiln runs and restart it, or use an address it lists")
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


def nul_refusal(request: HttpRequest) -> HttpResponse | None:
    """400 invalid_request naming the path or query parameter that holds a NUL character, for a /v1/ request."""
    if not (request.path + "/").startswith(API_PREFIX):
        return None
    field = None
    if "\x00" in request.path_info:
        try:
            kwargs = resolve(request.path_info).kwargs
        except Resolver404:
            kwargs = {}
        field = next((name for name, value in kwargs.items() if "\x00" in str(value)), "path")
    else:
        field = next((key for key, values in request.GET.lists()
                      if "\x00" in key or any("\x00" in value for value in values)), None)
    if field is None:
        return None
    return error_response(400, "invalid_request", f"{field} {NUL_TEXT}", field=field)


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
        return nul_refusal(request) or coded(request, self.get_response(request))

    async def _acall(self, request: HttpRequest):
        return nul_refusal(request) or coded(request, await self.get_response(request))
