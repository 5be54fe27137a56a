"""WebSocket routes: the jobs list and one job, both relaying kiln_web.jobs.events messages."""

from django.urls import path

from kiln_web.dashboard import consumers

websocket_urlpatterns = [
    path("ws/jobs/", consumers.JobListConsumer.as_asgi()),
    path("ws/jobs/<uuid:job_id>/", consumers.JobConsumer.as_asgi()),
]
