from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "kiln_web.core"
    label = "core"
    verbose_name = "Kiln core"

    def ready(self) -> None:
        from django.contrib.auth import get_user_model
        from django.db.models.signals import post_delete, post_save

        from kiln_web.accounts.models import ApiToken
        from kiln_web.core import checks  # noqa: F401  (registers the system checks)
        from kiln_web.core import fastpath

        # the job-status fast path never uses an authentication a token or user change made old
        for model in (ApiToken, get_user_model()):
            post_save.connect(fastpath.note_auth_changed, sender=model, dispatch_uid=f"fastpath-{model.__name__}-save")
            post_delete.connect(fastpath.note_auth_changed, sender=model,
                                dispatch_uid=f"fastpath-{model.__name__}-delete")
