"""WebSocket routes: the jobs list and one job, both relaying kiln_web.jobs.events messages; `routes` adds the
catch-all that closes any other path with 4404 (not an exception in the router)."""

from django.urls import path, re_path

from kiln_web.dashboard import consumers

websocket_urlpatterns = [
    path("ws/jobs/", consumers.JobListConsumer.as_asgi()),
    path("ws/jobs/<uuid:job_id>/", consumers.JobConsumer.as_asgi()),
]
routes = [*websocket_urlpatterns, re_path(r"", consumers.NoRoute.as_asgi())]  # what the ASGI router serves
