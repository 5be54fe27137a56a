"""Teacher aliases in the admin: changes go through the same actions as the API; revisions are read-only."""

from django import forms
from django.contrib import admin, messages

from kiln_web.core.http import ActionRefused
from kiln_web.teachers import actions
from kiln_web.teachers.models import SPEC_FIELDS, TeacherAlias

REVISIONS = ("identity_revision", "content_revision", "content_checked_at", "created_at", "updated_at")


class TeacherAliasForm(forms.ModelForm):
    class Meta:
        model = TeacherAlias
        fields = ("name", "owner", *SPEC_FIELDS)

    def clean(self):
        """Refuse what the action would refuse, on the form."""
        cleaned = super().clean()
        name = cleaned.get("name") or (self.instance.name if self.instance.pk else "")
        try:
            actions.validate_teacher(name, {key: cleaned.get(key) for key in SPEC_FIELDS})
            if self.instance.pk:
                actions.check_unused(self.instance)
        except ActionRefused as exc:
            field = exc.extra.get("field")
            raise forms.ValidationError({field: exc.message} if field in self.fields else exc.message) from None
        return cleaned


@admin.register(TeacherAlias)
class TeacherAliasAdmin(admin.ModelAdmin):
    form = TeacherAliasForm
    list_display = ("name", "route", "base", "adapter", "endpoint", "model", "owner", "short_identity",
                    "updated_at")
    list_filter = ("route", "updated_at")
    search_fields = ("name", "base", "adapter", "endpoint", "model", "owner__username", "identity_revision")
    readonly_fields = ("route", *REVISIONS)

    @admin.display(description="identity revision")
    def short_identity(self, alias: TeacherAlias) -> str:
        return alias.identity_revision[:12]

    def get_readonly_fields(self, request, obj=None):
        return self.readonly_fields + (("name", "owner") if obj is not None else ())

    def get_changeform_initial_data(self, request):
        return {"owner": request.user.pk}

    def save_model(self, request, obj, form, change):
        fields = {key: form.cleaned_data.get(key) for key in SPEC_FIELDS}
        if change:
            saved = actions.do_update_teacher(request.user, obj.name, fields)
        else:
            saved = actions.do_create_teacher(form.cleaned_data["owner"], obj.name, fields)
        obj.pk = saved.pk
        obj.refresh_from_db()

    def delete_model(self, request, obj):
        self.delete_queryset(request, [obj])

    def delete_queryset(self, request, queryset):
        for alias in queryset:
            try:
                actions.do_delete_teacher(request.user, alias.name)
            except ActionRefused as exc:
                self.message_user(request, f"{alias.name} was kept: {exc.message}", messages.ERROR)
