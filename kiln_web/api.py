"""The /v1/ HTTP API: one NinjaAPI with bearer-token auth on every operation and one error shape.

Every refusal is `{"error": {"code", "message", "field"?, "differences"?, ...}}` (the optional fields some codes
add are declared in kiln_web.core.http.ErrorBody); a view lets an action's
refusal propagate and the handler here answers it (kiln_web.core.http.refused). The schema at
/v1/openapi.json (and the browsable /v1/docs) is generated from the routers' schemas and
is the source of truth for request and response fields; it needs a token or a signed-in session.
"""

from functools import wraps

from django.core.exceptions import RequestDataTooBig
from django.http import Http404, HttpRequest
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.parser import Parser
from ninja.security import HttpBearer

from kiln_web.accounts.actions import authenticate_token
from kiln_web.core.http import (HTTP_CODES, NOT_JSON, ActionRefused, error_location, error_response, json_body,
                                refused)
from kiln_web.evals.api import router as evals_router
from kiln_web.jobs.api import router as train_router
from kiln_web.serving.api import promotions_router
from kiln_web.serving.api import router as adapters_router
from kiln_web.teachers.api import router as teachers_router


class BearerToken(HttpBearer):
    def authenticate(self, request: HttpRequest, token: str):
        user = authenticate_token(token)
        if user is not None:
            request.user = user
        return user


class JsonBody(Parser):
    """Request bodies as kiln_web.core.http.json_body reads them: NaN, Infinity, NUL characters and unpaired
    surrogates are refused with the field that holds them, before a view or a stored request could see them."""

    def parse_body(self, request: HttpRequest):
        return json_body(request.body)


UNAUTHORIZED = ("a valid API token is required: send 'Authorization: Bearer <token>' "
                "(create one with: kiln token create --user NAME)")


def _docs_access(view):
    """The schema and docs: for a bearer token or a signed-in session, like every other endpoint."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args, **kwargs):
        if not request.user.is_authenticated and BearerToken()(request) is None:
            return error_response(401, "unauthorized", UNAUTHORIZED)
        return view(request, *args, **kwargs)

    return wrapper


api = NinjaAPI(
    title="Kiln API",
    version="1",
    description="Training jobs, checkpoints and metrics, teacher aliases. Send 'Authorization: Bearer <token>' on every request.",
    auth=BearerToken(),
    urls_namespace="v1",
    docs_decorator=_docs_access,
    parser=JsonBody(),
)


def _field(error: dict) -> str | None:
    parts = list(error_location(error))
    if parts and parts[0] in {"body", "query", "path"}:
        parts = parts[1:]
    if parts and parts[0] in {"payload", "body"}:  # the operation's parameter name
        parts = parts[1:]
    return ".".join(parts) or None


def _sentence(error: dict) -> str:
    kind = error.get("type", "")
    field = _field(error) or "the request"
    if kind == "extra_forbidden":
        return f"unknown field {field!r}; /v1/openapi.json lists the accepted fields"
    if kind == "missing":
        return f"{field} is required"
    return f"{field}: {error.get('msg', 'invalid value')}"


@api.exception_handler(ValidationError)
def _invalid(request, exc: ValidationError):
    errors = exc.errors or [{}]
    message = "; ".join(_sentence(error) for error in errors)
    return error_response(400, "invalid_request", message, field=_field(errors[0]))


@api.exception_handler(AuthenticationError)
def _unauthorized(request, exc):
    return error_response(401, "unauthorized", UNAUTHORIZED)


@api.exception_handler(Http404)
def _not_found(request, exc):
    return error_response(404, "not_found", str(exc) or "no such resource")


@api.exception_handler(RequestDataTooBig)
def _too_large(request, exc):
    from django.conf import settings

    return error_response(413, "request_too_large",
                          f"the request body is larger than KILN_UPLOAD_MAX_BYTES ({settings.KILN_UPLOAD_MAX_BYTES} "
                          "bytes); put the dataset in a data root and send dataset_path instead")


@api.exception_handler(Exception)
def _refused(request, exc: Exception):
    """A failed action answers with the refusal it means (kiln_web.core.http.refusal_for); anything else is a
    bug and is raised for Django to answer 500."""
    return refused(exc)


@api.exception_handler(HttpError)
def _http_error(request, exc: HttpError):
    # django-ninja answers a body its parser refused with "Cannot parse request body", raised from the parser's error
    if isinstance(exc.__cause__, ActionRefused):
        return refused(exc.__cause__)
    message = NOT_JSON if exc.status_code == 400 and isinstance(exc.__cause__, ValueError) else exc.message
    return error_response(exc.status_code, HTTP_CODES.get(exc.status_code, "error"), message)


api.add_router("/train/", train_router)
api.add_router("/teachers", teachers_router)
api.add_router("/adapters", adapters_router)
api.add_router("/promotions", promotions_router)
api.add_router("/evals/", evals_router)
