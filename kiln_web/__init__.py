"""The Kiln web side: Django project, Channels routing and the Celery app."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kiln")
except PackageNotFoundError:  # running from a checkout that was never installed
    __version__ = "0+unknown"

from .celery import app as celery_app  # noqa: E402  (Django-Celery convention: loaded with the project)

__all__ = ("__version__", "celery_app")
