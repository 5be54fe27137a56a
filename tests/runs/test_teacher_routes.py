"""Served teachers (the `openai` and `vllm` routes): a `vllm` alias is an OpenAI-compatible server like `openai`,
and its content revision holds the numbers the server computes (log-probabilities of fixed probes), so other
weights behind the same model id, root and digest header are refused at resume."""

import pytest

from trainer import teachers
from trainer.bases import load_base
from trainer.peft import import_adapter
from trainer.runs import opd
from trainer.runs.admission import AdmissionError

from test_opd import TeacherServer, bases, make_settings, request, run  # noqa: F401 (bases: a fixture)


def served_teacher(server, route):
    spec = {"alias": f"tutor@{route}", "route": route, "endpoint": server.endpoint, "model": "sharp-tutor"}
    return {**spec, "identity_revision": teachers.identity_revision(spec)}


@pytest.fixture
def swappable(bases):  # noqa: F811 (the module fixture imported above)
    """A served teacher whose weights can be swapped behind the same id, root and digest header."""
    adapted, _ = load_base("kiln-sharp", bases)
    import_adapter(adapted, bases / "teacher-adapter")
    plain, _ = load_base("kiln-sharp", bases)
    served = TeacherServer(adapted, "sharp-tutor", "sha256:aaaa")
    yield served, plain
    served.close()
    adapted.close()
    plain.close()


def test_a_vllm_alias_is_an_openai_compatible_teacher(swappable, bases):  # noqa: F811
    server, _ = swappable
    spec = teachers.parse_teacher(served_teacher(server, "vllm"))
    assert spec.route == "vllm" and isinstance(teachers.open_teacher(spec, bases), teachers.OpenAITeacher)
    content = teachers.content_revision(spec, bases)
    assert content["evidence"]["route"] == "vllm" and content["evidence"]["model"] == "sharp-tutor"
    assert content == teachers.content_revision(spec, bases)  # the same server, the same revision
    with pytest.raises(ValueError, match="a vllm teacher needs endpoint"):
        teachers.parse_teacher({"alias": "x@vllm", "route": "vllm", "model": "m"})


@pytest.mark.parametrize("route", ["openai", "vllm"])
def test_other_weights_behind_the_same_name_are_refused_at_resume(swappable, bases, tmp_path, route):  # noqa: F811
    server, plain = swappable
    settings = make_settings(tmp_path, bases)
    teacher = served_teacher(server, route)
    before = teachers.content_revision(teachers.parse_teacher(teacher), bases)
    result, _ = run(settings, request(teacher, steps=3), stop=1)
    assert result.status == "cancelled"
    server.model = plain  # same id, root and digest header: only the numbers differ
    after = teachers.content_revision(teachers.parse_teacher(teacher), bases)
    assert after["evidence"]["digest"] == before["evidence"]["digest"]
    assert after["evidence"]["probe_logprobs"] != before["evidence"]["probe_logprobs"]
    with pytest.raises(AdmissionError) as info:
        opd.admit_opd(request(teacher, steps=3, resume_checkpoint=result.latest_checkpoint["resume_checkpoint"]),
                      settings)
    assert info.value.code == "teacher_changed"
    assert "teacher.content_evidence.probe_logprobs" in {d["field"] for d in info.value.differences}
