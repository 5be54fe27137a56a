from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "kiln_web.accounts"
    label = "accounts"
    verbose_name = "Kiln accounts"

    def ready(self) -> None:
        from django.contrib.auth import get_user_model
        from django.db.models.signals import post_delete, post_save

        from kiln_web.accounts.models import ApiToken
        from kiln_web.core import auth_cache

        # a token or user change in this process ends every remembered authentication at once
        for model in (ApiToken, get_user_model()):
            post_save.connect(auth_cache.note_auth_changed, sender=model,
                              dispatch_uid=f"auth-cache-{model.__name__}-save")
            post_delete.connect(auth_cache.note_auth_changed, sender=model,
                                dispatch_uid=f"auth-cache-{model.__name__}-delete")
