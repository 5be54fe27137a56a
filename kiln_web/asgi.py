"""ASGI entry point: Django for HTTP (with the static files), Channels consumers for WebSockets."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kiln_web.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()  # before anything that imports models

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from kiln_web.core.fastpath import JobStatusFastPath  # noqa: E402
from kiln_web.core.limits import BodyLimit  # noqa: E402
from kiln_web.dashboard.routing import routes as websocket_routes  # noqa: E402

application = ProtocolTypeRouter(
    {
        # The few local assets are served in-process, so `kiln up` needs no web server in front; request
        # bodies are bounded before Django spools them (kiln_web.core.limits); repeated job-status
        # polls are answered from Django's last answer (kiln_web.core.fastpath).
        "http": JobStatusFastPath(BodyLimit(ASGIStaticFilesHandler(django_asgi_app))),
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_routes))),
    }
)
