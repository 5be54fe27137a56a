"""Request and response shapes of /v1/teachers; /v1/openapi.json is generated from these."""

from __future__ import annotations

from datetime import datetime

from ninja import Schema
from pydantic import Field

from kiln_web.jobs.schemas import Strict
from kiln_web.teachers.models import ALIAS_PATTERN


class TeacherConfig(Strict):
    """native: base (and optionally adapter); openai and vllm: endpoint and model."""

    base: str | None = Field(None, min_length=1, description="native: a registered base with the student's "
                                                             "tokenizer (kiln base list)")
    adapter: str | None = Field(None, min_length=1, description="native, optional: an absolute PEFT adapter "
                                                                "directory in the adapter registry or a data root")
    endpoint: str | None = Field(None, min_length=1, description="openai, vllm: the root URL of an OpenAI-compatible "
                                                                 "server that returns prompt log-probabilities")
    model: str | None = Field(None, min_length=1, description="openai, vllm: the served model id")


class TeacherIn(TeacherConfig):
    name: str = Field(pattern=ALIAS_PATTERN, description="name@native or name@openai; the part after '@' is the "
                                                         "route")


class TeacherOut(Schema):
    name: str
    route: str
    base: str | None
    adapter: str | None
    endpoint: str | None
    model: str | None
    adapter_hidden: bool = Field(description="native: the adapter is one of the registry's that the caller may not "
                                             "see, so `adapter` is left out (null) and the alias cannot be their "
                                             "teacher")
    owner: str
    identity_revision: str = Field(description="SHA-256 of {alias, route, base, adapter, endpoint, model}: "
                                               "an OPD checkpoint binds it")
    content_revision: str | None = Field(description="the teacher's content revision as the latest OPD "
                                                     "admission reconstructed it; null before any")
    content_checked_at: datetime | None
    created_at: datetime
    updated_at: datetime


class TeacherListOut(Schema):
    items: list[TeacherOut]
