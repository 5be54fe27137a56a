"""The API's one error shape: {"error": {"code", "message", "field"?, "differences"?, ...}}, and the
refusal every action raises to produce it."""

from django.http import JsonResponse


class ActionRefused(Exception):
    """A refusal with an HTTP status, a machine-readable code and a sentence a person can act on."""

    def __init__(self, status: int, code: str, message: str, **extra):
        self.status, self.code, self.message, self.extra = status, code, message, extra
        super().__init__(message)

    def as_error(self) -> dict:
        return {"code": self.code, "message": self.message} | self.extra


def error_response(status: int, code: str, message: str, **extra) -> JsonResponse:
    error = {"code": code, "message": message} | {key: value for key, value in extra.items() if value is not None}
    response = JsonResponse({"error": error}, status=status)
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="kiln"'
    return response
