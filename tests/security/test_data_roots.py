"""Paths a request names stay inside the configured roots: a dataset_path (SFT, GRPO, OPD, the API and the
dashboard) inside KILN_DATA_ROOTS, an OPD base_adapter and a native teacher's adapter inside the adapter
registry or a data root, a resume_checkpoint directly inside the registry. `..`, a symlink that leaves a
root, an absolute path elsewhere, a sibling that shares a root's prefix, a relative path and a NUL byte
are all refused, before anything exists; and a file swapped for an escaping symlink after admission is
refused again when the run starts. The real trainer's admission (trainer.runs.*) is what is tested."""

import json
import os

import pytest
from django.test import Client

from kiln_web.jobs.execution import execute_training_job
from kiln_web.jobs.models import TrainingJob

from .conftest import session

pytestmark = pytest.mark.django_db

SFT_RECORDS = [{"messages": [{"role": "user", "content": "Say kiln."}, {"role": "assistant", "content": "KILN!"}]}]
GROUPS = [{"prompt": "Say kiln.", "completions": [{"text": "KILN!", "reward": 1.0}, {"text": "no", "reward": 0.0}]}]


@pytest.fixture
def roots(settings, tmp_path):
    """Two data roots (the datasets folder and an extra one), a good file in each, and files outside."""
    extra = tmp_path / "data"
    outside = tmp_path / "outside"
    for folder in (extra, outside, tmp_path / "data-evil"):
        folder.mkdir()
    settings.KILN_DATA_ROOTS = (settings.KILN_DATASETS_DIR, extra)
    settings.KILN_HEARTBEAT_SECONDS = 3600
    lines = {"sft": SFT_RECORDS, "grpo": GROUPS, "opd": [{"prompt": "Say kiln."}]}
    for folder in (extra, outside, tmp_path / "data-evil"):
        for kind, records in lines.items():
            (folder / f"{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (extra / "escape.jsonl").symlink_to(outside / "sft.jsonl")
    (extra / "escape-dir").symlink_to(outside, target_is_directory=True)
    return {"extra": extra, "outside": outside, "tmp": tmp_path}


def escapes(roots, kind: str) -> dict:
    extra, outside = roots["extra"], roots["outside"]
    return {
        "dot-dot": f"{extra}/../outside/{kind}.jsonl",
        "dot-dot from the datasets folder": f"{extra}/../../../../../../../../..{outside}/{kind}.jsonl",
        "symlinked file": str(extra / "escape.jsonl"),
        "through a symlinked folder": f"{extra}/escape-dir/{kind}.jsonl",
        "absolute elsewhere": f"{outside}/{kind}.jsonl",
        "system file": "/etc/passwd",
        "sibling sharing the prefix": f"{roots['tmp']}/data-evil/{kind}.jsonl",
        "the root itself": str(extra),
        "relative": f"{kind}.jsonl",
        "NUL byte": f"{extra}/{kind}.jsonl\x00.txt",
    }


def body(kind: str, adapter: str, path: str, teacher: str | None = None) -> dict:
    config = {"output_name": adapter}
    if kind == "opd":
        config["teacher"] = teacher
    return {"dataset_path": path, "config": config}


@pytest.fixture
def native_teacher(world) -> str:
    """A kiln-tiny teacher: OPD admission reaches it without a network."""
    from kiln_web.teachers.actions import do_create_teacher

    return do_create_teacher(world.owner, "tiny@native", {"base": "kiln-tiny"}).name


@pytest.mark.parametrize("kind", ["sft", "grpo", "opd"])
def test_dataset_paths_outside_the_roots_are_refused(world, roots, native_teacher, kind):
    world.teacher = native_teacher
    api = Client(HTTP_AUTHORIZATION=f"Bearer {world.owner.token}")
    jobs = TrainingJob.objects.count()
    for name, path in escapes(roots, kind).items():
        response = api.post(f"/v1/train/{kind}", body(kind, f"confined-{kind}", path, world.teacher),
                            content_type="application/json")
        assert response.status_code == 400, (name, response.content[:300])
        error = response.json()["error"]
        assert error["code"] in ("dataset_outside_roots", "invalid_request"), (name, error)
        if error["code"] == "invalid_request":
            assert error.get("field") == "dataset_path", (name, error)
    assert TrainingJob.objects.count() == jobs
    # the same request with a file inside a root is admitted (the refusals above are about the path)
    inside = api.post(f"/v1/train/{kind}", body(kind, f"confined-{kind}", str(roots["extra"] / f"{kind}.jsonl"),
                                                world.teacher), content_type="application/json")
    assert inside.status_code == 201, inside.content[:500]


def test_the_dashboard_refuses_a_dataset_path_outside_the_roots(world, roots):
    browser = session(world.owner, csrf=False)
    response = browser.post("/jobs/new/sft/", {"output_name": "confined-form", "dataset_path": "/etc/passwd"})
    assert response.status_code == 400
    assert "outside the configured data roots" in response.content.decode()
    assert not TrainingJob.objects.filter(adapter__name="confined-form").exists()


def test_a_file_swapped_for_an_escaping_symlink_after_admission_is_refused_at_the_run(world, roots):
    api = Client(HTTP_AUTHORIZATION=f"Bearer {world.owner.token}")
    path = roots["extra"] / "swapped.jsonl"
    path.write_text((roots["extra"] / "sft.jsonl").read_text())
    response = api.post("/v1/train/sft", body("sft", "swapped", str(path)), content_type="application/json")
    assert response.status_code == 201, response.content[:300]
    path.unlink()
    path.symlink_to(roots["outside"] / "sft.jsonl")  # the same bytes, outside every root
    assert execute_training_job(response.json()["id"], "test-worker") == "failed"
    job = TrainingJob.objects.get(pk=response.json()["id"])
    assert job.status == "failed" and job.error_code == "dataset_outside_roots", (job.error_code, job.error_message)
    assert job.committed_step == 0 and job.latest_checkpoint is None


def test_adapter_directories_outside_the_roots_are_refused(world, roots, settings):
    api = Client(HTTP_AUTHORIZATION=f"Bearer {world.owner.token}")
    peft = roots["outside"] / "peft"
    peft.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (peft / name).write_bytes(b"{}")
    (roots["extra"] / "peft-link").symlink_to(peft, target_is_directory=True)
    for path in (str(peft), f"{roots['extra']}/../outside/peft", str(roots["extra"] / "peft-link"), "/etc"):
        teacher = api.post("/v1/teachers", {"name": "escape@native", "base": "kiln-tiny", "adapter": path},
                           content_type="application/json")
        assert teacher.status_code == 400, (path, teacher.content[:300])
        assert teacher.json()["error"]["code"] == "adapter_outside_roots", (path, teacher.json())
        opd = api.post("/v1/train/opd", {"prompts": ["p"], "config": {"output_name": "warm", "teacher": world.teacher,
                                                                       "base_adapter": path}},
                       content_type="application/json")
        assert opd.status_code == 400, (path, opd.content[:300])
        assert opd.json()["error"]["code"] == "base_adapter_outside_roots", (path, opd.json())


@pytest.mark.parametrize("reference", ["../x", "/etc", "a/../../b", "{registry}/../{checkpoint}",
                                       "{registry}//{checkpoint}", "{outside}/{checkpoint}", "{link}"])
def test_resume_checkpoints_outside_the_registry_are_refused(world, roots, settings, reference):
    registry = settings.KILN_ADAPTERS_DIR
    copy = roots["outside"] / world.checkpoint
    os.symlink(registry / world.checkpoint, copy)
    link = registry / f"{world.adapter}-000000099.kiln-checkpoint"
    if not link.exists():
        link.symlink_to(registry / world.checkpoint, target_is_directory=True)
    reference = reference.format(registry=registry, checkpoint=world.checkpoint, outside=roots["outside"],
                                 link=link.name)
    settings.KILN_SFT_RUNNER = "controlplane.fake_sft"
    api = Client(HTTP_AUTHORIZATION=f"Bearer {world.owner.token}")
    response = api.post("/v1/train/sft", {"data": [{"prompt": "q", "completion": "a"}],
                                          "config": {"output_name": world.adapter, "resume_checkpoint": reference}},
                        content_type="application/json")
    assert response.status_code == 400, (reference, response.content[:300])
    assert response.json()["error"]["code"] in ("outside_registry", "noncanonical_name", "symlink", "not_found",
                                                "bad_path"), response.json()
