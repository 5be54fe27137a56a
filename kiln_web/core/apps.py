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
        from kiln_web.jobs.models import TrainingJob

        # the job-status fast path never replays what a token, user or job change made old
        for model in (ApiToken, get_user_model()):
            post_save.connect(fastpath.note_auth_changed, sender=model, dispatch_uid=f"fastpath-{model.__name__}-save")
            post_delete.connect(fastpath.note_auth_changed, sender=model,
                                dispatch_uid=f"fastpath-{model.__name__}-delete")
        post_save.connect(_job_saved, sender=TrainingJob, dispatch_uid="fastpath-job-save")


def _job_saved(sender, instance, **_) -> None:
    from django.db import transaction

    from kiln_web.core import fastpath

    transaction.on_commit(lambda: fastpath.note_job_changed(instance.pk))
