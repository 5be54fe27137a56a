"""Served adapters and the promotion audit trail in the admin: read-only; changes go through the actions."""

from django.contrib import admin

from kiln_web.serving.models import PromotionRecord, ServedAdapter


@admin.register(ServedAdapter)
class ServedAdapterAdmin(admin.ModelAdmin):
    list_display = ("adapter", "base", "active", "generation", "loaded_by", "loaded_at", "activated_at")
    list_filter = ("active", "base")
    search_fields = ("adapter__name", "base", "adapter_sha256")
    readonly_fields = ("adapter", "base", "adapter_sha256", "generation", "active", "loaded_by", "loaded_at",
                       "activated_at")

    def has_add_permission(self, request) -> bool:
        return False  # loading goes through the API or the CLI, which load the snapshot first


@admin.register(PromotionRecord)
class PromotionRecordAdmin(admin.ModelAdmin):
    """Which adapter, which evaluation, the outcome, when, and who or which gate decided."""

    list_display = ("decided_at", "adapter", "outcome", "decided_by", "job", "evaluation", "previous_active")
    list_filter = ("outcome", "decided_by", "decided_at")
    search_fields = ("adapter__name", "reason", "decided_by", "job__id", "evaluation__id", "adapter_sha256")
    date_hierarchy = "decided_at"
    list_select_related = ("adapter",)
    readonly_fields = ("adapter", "job", "evaluation", "outcome", "reason", "decided_by", "user", "adapter_sha256",
                       "previous_active", "decided_at")

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # an audit trail
