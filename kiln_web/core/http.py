"""The API's one error shape: {"error": {"code", "message", "field"?, "differences"?, ...}}."""

from django.http import JsonResponse


def error_response(status: int, code: str, message: str, **extra) -> JsonResponse:
    error = {"code": code, "message": message} | {key: value for key, value in extra.items() if value is not None}
    response = JsonResponse({"error": error}, status=status)
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="kiln"'
    return response
