"""The OpenAI-compatible endpoints beneath /v1/ (async views; the rest of /v1/ is the Ninja API)."""

from django.urls import path

from kiln_web.serving import views

urlpatterns = [
    path("completions", views.completions, name="completions"),
    path("chat/completions", views.chat_completions, name="chat-completions"),
    path("models", views.models, name="models"),
]
