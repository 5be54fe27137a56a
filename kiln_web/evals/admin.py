"""Suites and evaluation runs in the admin: browse and search; results are read-only."""

from django.contrib import admin

from kiln_web.evals.models import EvalExampleResult, EvalRun, EvalSuite


@admin.register(EvalSuite)
class EvalSuiteAdmin(admin.ModelAdmin):
    list_display = ("name", "owner", "example_count", "default_metric", "digest", "created_at")
    search_fields = ("name", "owner__username", "digest")
    readonly_fields = ("name", "owner", "content", "digest", "default_metric", "example_count", "created_at")

    def has_add_permission(self, request) -> bool:
        return False  # created through the API or the CLI, which parse the content


class ExampleInline(admin.TabularInline):
    model = EvalExampleResult
    fields = ("index", "metric", "expected", "candidate_output", "candidate_correct", "baseline_output",
              "baseline_correct")
    readonly_fields = fields
    extra = 0
    can_delete = False


@admin.register(EvalRun)
class EvalRunAdmin(admin.ModelAdmin):
    list_display = ("id", "candidate", "suite", "baseline", "status", "purpose", "training_job", "created_at")
    list_filter = ("status", "purpose", "baseline_kind", "created_at")
    search_fields = ("id", "candidate__name", "suite__name", "baseline", "training_job__id")
    list_select_related = ("candidate", "suite")
    readonly_fields = [field.name for field in EvalRun._meta.fields]
    inlines = [ExampleInline]

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(EvalExampleResult)
class EvalExampleResultAdmin(admin.ModelAdmin):
    list_display = ("run", "index", "metric", "candidate_correct", "baseline_correct")
    list_filter = ("metric", "candidate_correct", "baseline_correct")
    search_fields = ("run__id", "expected", "candidate_output", "baseline_output")
    list_select_related = ("run",)
    readonly_fields = ("run", "index", "expected", "metric", "candidate_output", "candidate_correct",
                       "baseline_output", "baseline_correct")

    def has_add_permission(self, request) -> bool:
        return False
