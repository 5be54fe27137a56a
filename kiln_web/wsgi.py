"""WSGI entry point, for HTTP-only hosting; `kiln up` serves the ASGI app instead."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kiln_web.settings")

application = get_wsgi_application()
