from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "kiln_web.accounts"
    label = "accounts"
    verbose_name = "Kiln accounts"
