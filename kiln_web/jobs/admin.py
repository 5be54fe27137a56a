"""Jobs in the admin: browse, filter and search; identities and history are read-only.

State changes are not edited here: cancelling goes through the same action as the API.
"""

from django.contrib import admin, messages

from kiln_web.jobs.actions import do_cancel_job
from kiln_web.jobs.models import JobEvent, JobMetric, TrainingJob, WorkerRecord


class JobEventInline(admin.TabularInline):
    model = JobEvent
    fields = ("time", "level", "message")
    readonly_fields = fields
    extra = 0
    can_delete = False
    ordering = ("time", "id")


@admin.register(TrainingJob)
class TrainingJobAdmin(admin.ModelAdmin):
    list_display = ("id", "kind", "adapter", "owner", "status", "committed_step", "total_steps",
                    "error_code", "created_at", "finished_at")
    list_filter = ("status", "kind", "data_source_kind", "created_at")
    search_fields = ("id", "adapter__name", "owner__username", "error_code", "error_message", "worker_id",
                     "resume_from")
    date_hierarchy = "created_at"
    list_select_related = ("adapter", "owner")
    readonly_fields = [field.name for field in TrainingJob._meta.fields]
    inlines = [JobEventInline]
    actions = ["cancel_jobs"]

    def has_add_permission(self, request) -> bool:
        return False  # jobs are submitted through the API or the CLI, which run admission

    @admin.action(description="Cancel the selected jobs (running ones publish a checkpoint first)")
    def cancel_jobs(self, request, queryset):
        done = 0
        for job in queryset:
            if job.is_active:
                do_cancel_job(job.pk, reason=f"cancelled in the admin by {request.user.get_username()}")
                done += 1
        self.message_user(request, f"cancelled or cancelling {done} job(s)", messages.SUCCESS)


@admin.register(JobMetric)
class JobMetricAdmin(admin.ModelAdmin):
    list_display = ("job", "step")
    list_filter = ("job__status",)
    search_fields = ("job__id", "job__adapter__name")
    readonly_fields = ("job", "step", "metrics")

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(JobEvent)
class JobEventAdmin(admin.ModelAdmin):
    list_display = ("time", "job", "level", "message")
    list_filter = ("level", "time")
    search_fields = ("message", "job__id", "job__adapter__name")
    readonly_fields = ("job", "time", "level", "message")

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(WorkerRecord)
class WorkerRecordAdmin(admin.ModelAdmin):
    """Workers and the execution identity each computed at start; written by the workers only."""

    list_display = ("worker_id", "identity_sha256", "started_at", "heartbeat_at", "stopped_at")
    list_filter = ("stopped_at", "heartbeat_at")
    search_fields = ("worker_id", "identity_sha256")
    readonly_fields = ("worker_id", "identity", "identity_sha256", "started_at", "heartbeat_at", "stopped_at")

    def has_add_permission(self, request) -> bool:
        return False
