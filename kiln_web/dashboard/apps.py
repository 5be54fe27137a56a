from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "kiln_web.dashboard"
    label = "dashboard"
    verbose_name = "Kiln dashboard"
