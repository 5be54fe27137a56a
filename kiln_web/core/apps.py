from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "kiln_web.core"
    label = "core"
    verbose_name = "Kiln core"

    def ready(self) -> None:
        from kiln_web.core import checks  # noqa: F401  (registers the system checks)
