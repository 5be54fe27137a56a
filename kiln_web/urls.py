"""URL routes: the dashboard at the root, health check, sign-in, the admin, the OpenAI-compatible
completions and the /v1/ API."""

from django.contrib import admin
from django.urls import include, path

from kiln_web.api import api
from kiln_web.core import views

urlpatterns = [
    path("healthz", views.healthz, name="healthz"),
    path("accounts/", include("django.contrib.auth.urls")),
    path("admin/", admin.site.urls),
    path("v1/", include("kiln_web.serving.urls")),  # the OpenAI-compatible endpoints (async views)
    path("v1/", api.urls),
    path("", include("kiln_web.dashboard.urls")),
]
