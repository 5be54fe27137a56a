"""Dashboard pages, included at the site root."""

from django.urls import path

from kiln_web.dashboard import eval_views, views

app_name = "dashboard"

urlpatterns = [
    path("", views.jobs, name="jobs"),
    path("jobs/rows", views.job_rows, name="job_rows"),
    path("jobs/new/<slug:kind>/", views.new_job, name="new_job"),
    path("jobs/<uuid:job_id>/", views.job_detail, name="job"),
    path("jobs/<uuid:job_id>/snapshot", views.job_snapshot, name="job_snapshot"),
    path("jobs/<uuid:job_id>/stop/", views.stop_job, name="stop_job"),
    path("jobs/<uuid:job_id>/resume/", views.resume_job, name="resume_job"),
    path("adapters/", views.adapters, name="adapters"),
    path("adapters/<str:name>/", views.adapter_detail, name="adapter"),
    path("adapters/<str:name>/<str:action>/", views.adapter_action, name="adapter_action"),
    path("evals/", eval_views.eval_runs, name="eval_runs"),
    path("evals/runs/<uuid:run_id>/", eval_views.eval_run, name="eval_run"),
    path("promotions/", eval_views.promotions, name="promotions"),
    path("qualification/", views.qualification, name="qualification"),
    path("teachers/", views.teachers, name="teachers"),
    path("teachers/<str:name>/delete/", views.delete_teacher, name="delete_teacher"),
]
