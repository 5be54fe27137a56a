from django.apps import AppConfig


class TeachersConfig(AppConfig):
    name = "kiln_web.teachers"
    label = "teachers"
    verbose_name = "Kiln teacher aliases"
