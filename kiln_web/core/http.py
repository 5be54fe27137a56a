"""The API's one error shape ({"error": {"code", "message", "field"?, "differences"?, ...}}), its schema, the one
table of HTTP statuses for coded failures, and `refusal_for`, which every API module and dashboard view uses to
turn a failure into a refusal."""

import json
import math
import re
from typing import Any

from django.http import JsonResponse
from ninja import Schema
from pydantic import ConfigDict, Field
from pydantic_core import PydanticCustomError

try:
    from ninja import Status
except ImportError:  # django-ninja before 1.6 returned (status, body) tuples
    def Status(status_code: int, body):  # noqa: N802
        return status_code, body


class ActionRefused(Exception):
    """A refusal with an HTTP status, a machine-readable code and a sentence a person can act on."""

    def __init__(self, status: int, code: str, message: str, **extra):
        self.status, self.code, self.message, self.extra = status, code, message, extra
        super().__init__(message)

    def as_error(self) -> dict:
        return {"code": self.code, "message": self.message} | self.extra


# The status for each code a failure carries on its way out of an action (an exception with a `code`
# attribute that is not an ActionRefused); a code not listed here is not a refusal, and propagates.
STATUS = {
    "job_not_active": 409,  # InvalidTransition: the job has already ended
    "runner_unavailable": 503,  # the configured run module does not import
    "adapter_not_found": 404,
    "model_not_found": 404,  # the OpenAI-compatible endpoints: no loaded adapter or base by that name
    "base_not_found": 400,  # loading an adapter over a base that is not registered
    "model_required": 400,
    "adapter_not_loaded": 409,
    "adapter_incompatible": 409,
    "adapter_name_reserved": 409,  # an adapter named like a registered base: the name means the base
    "adapter_unavailable": 503,
    "adapter_changed": 503,
    "backend_unavailable": 503,  # serving: the process's configured backend (cuda) has no usable device
}


# The code of a refusal known only by its HTTP status (django-ninja's HttpError, Django's own 404 and 405 pages).
HTTP_CODES = {400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
              405: "method_not_allowed", 409: "conflict", 413: "request_too_large", 500: "internal_error"}
NOT_JSON = "the request body is not JSON"  # the same words from the training API and the serving endpoints
NUL_TEXT = "holds a NUL character (U+0000), which no database text field keeps; remove it"
# what may spell a value json_body refuses, in the body's text; a body without any of these is not walked
_SUSPECT = re.compile(r"NaN|Infinity|\\u0000|\\u[dD][89a-fA-F]|[\ud800-\udfff]")


def json_body(raw: bytes, *, stored: bool = True):
    """RAW parsed as a /v1/ request body. ValueError when it is not JSON, nesting too deep for the parser included;
    ActionRefused (400 invalid_request, naming the field) for what Python's json reads but no JSON value is and
    nothing downstream can take: NaN and Infinity, an unpaired UTF-16 surrogate escape (not text: the tokenizer
    refuses it), and, in a body that is STORED, a NUL character (PostgreSQL text and jsonb refuse it)."""
    if isinstance(raw, (bytes, bytearray)):  # as json.loads decodes bytes (UTF-8, -16 or -32; surrogates pass)
        raw = bytes(raw).decode(json.detect_encoding(raw), "surrogatepass")
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if _SUSPECT.search(raw):
        _check_values(value, stored)
    return value


def _text_problem(text: str, stored: bool) -> str | None:
    if stored and "\x00" in text:
        return NUL_TEXT
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff alone), which is not text"
    return None


def _check_values(value, stored: bool) -> None:
    """Refuse the first value json_body must not pass on, by its dotted location: walked depth first without
    recursion, holding only the path to the value at hand (a body is up to KILN_UPLOAD_MAX_BYTES of values)."""
    path, stack = [], [iter(((None, value),))]
    while stack:
        for key, item in stack[-1]:
            problem, name = None, None
            if isinstance(item, float) and not math.isfinite(item):
                problem = "must be a finite number (JSON has no NaN or Infinity)"
            elif isinstance(item, str):
                problem = _text_problem(item, stored)
            elif isinstance(item, dict):
                for name in item:
                    name_problem = _text_problem(name, stored)
                    if name_problem is not None:
                        problem = f"its name {name_problem}"
                        break
                else:
                    path.append(key)
                    stack.append(iter(item.items()))
                    break
            elif isinstance(item, list):
                path.append(key)
                stack.append(iter(enumerate(item)))
                break
            if problem is not None:
                field = ".".join(str(part) for part in (*path, key, name) if part is not None) or None
                raise ActionRefused(400, "invalid_request", f"{field or 'the request'}: {problem}", field=field)
        else:
            stack.pop()
            del path[len(stack) - 1:]


def refusal_for(exc: BaseException) -> ActionRefused | None:
    """The refusal EXC means (itself when it is one; a coded failure with its status from STATUS), or None for
    anything else, which the caller re-raises. Trainer refusals arrive here already mapped by the actions."""
    if isinstance(exc, ActionRefused):
        return exc
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code in STATUS:
        return ActionRefused(STATUS[code], code, str(getattr(exc, "message", None) or exc))
    return None


def field_refusal(field: str, message: str) -> PydanticCustomError:
    """What a model validator raises to refuse FIELD (a name in its own model): pydantic gives a model validator's
    error no location, so the field travels in the error's context and error_location puts it back."""
    return PydanticCustomError("invalid_field", message, {"field": field})


def error_location(error: dict) -> tuple[str, ...]:
    """Where a pydantic error (one of ValidationError.errors()) lies: its location, then the field a model
    validator named with field_refusal."""
    location = tuple(str(part) for part in error.get("loc", ()))
    if error.get("type") == "invalid_field" and (error.get("ctx") or {}).get("field"):
        location += (str(error["ctx"]["field"]),)
    return location


def error_response(status: int, code: str, message: str, **extra) -> JsonResponse:
    error = {"code": code, "message": message} | {key: value for key, value in extra.items() if value is not None}
    response = JsonResponse({"error": error}, status=status)
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="kiln"'
    return response


def refused(exc: Exception) -> JsonResponse:
    """The API's answer to a failed action: the refusal EXC means, else EXC itself is re-raised."""
    refusal = refusal_for(exc)
    if refusal is None:
        raise exc
    return error_response(refusal.status, refusal.code, refusal.message, **refusal.extra)


class ErrorBody(Schema):
    code: str = Field(description="machine-readable, e.g. invalid_request, resume_drift, unauthorized")
    message: str = Field(description="a sentence a person can act on")
    field: str | None = Field(None, description="the request field at fault, dotted: config.checkpoint_interval")
    differences: list[dict[str, Any]] | None = Field(
        None, description="resume drift: [{field, checkpoint, request}, ...]")
    job_id: str | None = Field(None, description="the job in the way: adapter_busy, teacher_in_use")
    evaluation_id: str | None = Field(None, description="the evaluation in the way: adapter_busy")
    matches: list[str] | None = Field(None, description="ambiguous_job_id: the full ids the prefix matches")
    candidate_base: str | None = Field(None, description="cross_base_comparison: the candidate adapter's base")
    baseline_base: str | None = Field(None, description="cross_base_comparison: the baseline's base")

    model_config = ConfigDict(extra="allow")


class ErrorOut(Schema):
    error: ErrorBody


def refusals(*statuses: int) -> dict:
    """The `response=` entries of an operation's refusals: 400, 401, 403, 404 and 409, and STATUSES."""
    return {status: ErrorOut for status in (400, 401, 403, 404, 409, *statuses)}
