from django.apps import AppConfig


class ServingConfig(AppConfig):
    name = "kiln_web.serving"
    label = "serving"
    verbose_name = "Kiln serving and promotion"

    def ready(self) -> None:
        from kiln_web.serving import promotion  # noqa: F401  (connects the job and evaluation signals)
