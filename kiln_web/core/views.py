"""The health check (the pages themselves are the dashboard's)."""

from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

import kiln_web


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok", "version": kiln_web.__version__})
