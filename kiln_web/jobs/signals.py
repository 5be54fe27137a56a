"""Signals other apps build on; sent only after the database commit."""

from django.dispatch import Signal

# a training job became succeeded; keyword argument job_id. Promotion (kiln_web.serving) listens.
job_succeeded = Signal()
