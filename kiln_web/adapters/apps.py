from django.apps import AppConfig


class AdaptersConfig(AppConfig):
    name = "kiln_web.adapters"
    label = "adapters"
    verbose_name = "Kiln adapters"
