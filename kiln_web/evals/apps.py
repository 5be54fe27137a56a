from django.apps import AppConfig


class EvalsConfig(AppConfig):
    name = "kiln_web.evals"
    label = "evals"
    verbose_name = "Kiln evaluations"
