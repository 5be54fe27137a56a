from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "kiln_web.dashboard"
    label = "dashboard"
    verbose_name = "Kiln dashboard"

    def ready(self) -> None:
        from django.contrib.auth import get_user_model
        from django.contrib.auth.signals import user_logged_out
        from django.db.models.signals import post_delete, post_save

        from kiln_web.jobs import events

        # an open WebSocket is judged again when its person's account changes or their session signs out
        post_save.connect(events.note_user_changed, sender=get_user_model(), dispatch_uid="sockets-user-save")
        post_delete.connect(events.note_user_changed, sender=get_user_model(), dispatch_uid="sockets-user-delete")
        user_logged_out.connect(events.note_signed_out, dispatch_uid="sockets-signed-out")
