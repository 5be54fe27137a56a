"""System checks for what the settings cannot verify on their own."""

from django.conf import settings
from django.core.checks import Error, register


@register()
def check_assets(app_configs, **kwargs):
    template = settings.ASSETS_DIR / "templates" / "base.html"
    if template.is_file():
        return []
    return [
        Error(
            f"templates not found: {template} does not exist",
            hint="set KILN_ASSETS_DIR to the Kiln source checkout (the folder holding templates/ and static/)",
            id="kiln.E001",
        )
    ]
