"""The landing page and the health check."""

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

import kiln_web


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok", "version": kiln_web.__version__})


@require_GET
@login_required
def index(request: HttpRequest) -> HttpResponse:
    return render(request, "index.html", {"version": kiln_web.__version__})
