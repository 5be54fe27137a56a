from django.contrib import admin

from kiln_web.adapters.models import Adapter, AdapterShare, CheckpointRecord


class CheckpointInline(admin.TabularInline):
    model = CheckpointRecord
    fields = ("basename", "step", "job", "checkpoint_id", "created_at")
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True


@admin.register(Adapter)
class AdapterAdmin(admin.ModelAdmin):
    list_display = ("name", "owner", "created_at")
    list_filter = ("created_at",)
    search_fields = ("name", "owner__username")
    readonly_fields = ("created_at",)
    inlines = [CheckpointInline]


@admin.register(AdapterShare)
class AdapterShareAdmin(admin.ModelAdmin):
    """Who besides its owner (and staff) may use an adapter; `kiln adapter share` writes these."""

    list_display = ("adapter", "user", "group", "created_by", "created_at")
    list_filter = ("created_at",)
    search_fields = ("adapter__name", "user__username", "group__name")
    raw_id_fields = ("adapter", "user", "group", "created_by")
    readonly_fields = ("created_at",)


@admin.register(CheckpointRecord)
class CheckpointRecordAdmin(admin.ModelAdmin):
    """An index written by the workers; the files under $KILN_HOME/adapters are the authority."""

    list_display = ("basename", "adapter", "step", "job", "created_at")
    list_filter = ("created_at", "adapter")
    search_fields = ("basename", "checkpoint_id", "manifest_digest", "adapter__name", "job__id")
    readonly_fields = ("job", "adapter", "basename", "step", "checkpoint_id", "manifest_digest",
                       "summary", "timing", "created_at")

    def has_add_permission(self, request) -> bool:
        return False
