from django.contrib import admin

from kiln_web.accounts.models import ApiToken


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Tokens are created with `kiln token create` (the text is shown once); here they are listed and revoked."""

    list_display = ("prefix", "name", "user", "created_at", "last_used_at")
    list_filter = ("created_at", "last_used_at")
    search_fields = ("name", "prefix", "user__username")
    readonly_fields = ("user", "prefix", "token_hash", "created_at", "last_used_at")
    fields = ("user", "name", "prefix", "token_hash", "created_at", "last_used_at")

    def has_add_permission(self, request) -> bool:
        return False  # a token made here could never be shown to anyone
