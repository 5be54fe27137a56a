"""URL routes: the landing page, health check, sign-in and the admin."""

from django.contrib import admin
from django.urls import include, path

from kiln_web.core import views

urlpatterns = [
    path("", views.index, name="index"),
    path("healthz", views.healthz, name="healthz"),
    path("accounts/", include("django.contrib.auth.urls")),
    path("admin/", admin.site.urls),
]
