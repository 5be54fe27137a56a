from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "kiln_web.jobs"
    label = "jobs"
    verbose_name = "Kiln training jobs"
