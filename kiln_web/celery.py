"""The Celery app "kiln", configured from the CELERY_* Django settings; tasks are found in each app."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kiln_web.settings")

app = Celery("kiln")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
