"""Dashboard pages with the fake SFT runner: sign-in, ownership, the schema-driven form and its refusals,
Stop and save, prepare-resume (data cleared, refused without a source, drift shown as a table), panels."""

import json
import re
import shutil
import uuid

import pytest
from django.apps import apps
from django.conf import settings
from django.contrib import admin
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from kiln_web.dashboard.forms import SFTJobForm
from kiln_web.jobs.models import JobMetric, JobStatus, TrainingJob
from kiln_web.jobs.schemas import GRPORequest, OPDRequest, SFTRequest

from .conftest import RECORDS, cancel_at, csrf_post, run_queued, upload

pytestmark = pytest.mark.django_db


def submit_form(client, adapter, **fields):
    data = {"output_name": adapter, "data": upload(), **fields}
    return csrf_post(client, "/jobs/new/sft/", data)


def submitted(response) -> TrainingJob:
    assert response.status_code == 302, response.content.decode()[:3000]
    match = re.fullmatch(r"/jobs/([0-9a-f-]{36})/", response["Location"])
    assert match, response["Location"]
    return TrainingJob.objects.get(pk=match.group(1))


def schema_leaves(model, prefix=()):
    """Every leaf field of a request schema, as a path."""
    for name, info in model.model_fields.items():
        annotation = info.annotation
        args = [a for a in getattr(annotation, "__args__", ()) if a is not type(None)]
        inner = args[0] if len(args) == 1 else annotation
        if isinstance(inner, type) and hasattr(inner, "model_fields"):
            yield from schema_leaves(inner, prefix + (name,))
        else:
            yield prefix + (name,)


# -- sign-in and ownership --


@pytest.mark.parametrize("path", ["/", "/jobs/rows", "/jobs/new/sft/", "/adapters/", "/adapters/x/",
                                  f"/jobs/{uuid.uuid4()}/", f"/jobs/{uuid.uuid4()}/snapshot",
                                  f"/jobs/{uuid.uuid4()}/resume/"])
def test_every_page_needs_a_signed_in_user(client, path):
    response = client.get(path)
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/?next=")


def test_stop_needs_sign_in_and_post(client, signed_in):
    job_id = uuid.uuid4()
    assert client.post(f"/jobs/{job_id}/stop/")["Location"].startswith("/accounts/login/")
    assert signed_in.get(f"/jobs/{job_id}/stop/").status_code == 405


def test_forms_refuse_a_post_without_the_csrf_token(browser, adapter_name):
    assert browser.post("/jobs/new/sft/", {"output_name": adapter_name}).status_code == 403


def test_someone_elses_job_is_404_and_staff_see_it(fake_runner, signed_in, bob, make_user, adapter_name):
    other = Client()
    other.force_login(bob)
    job = submitted(submit_form(other, adapter_name))
    for path in ("", "snapshot", "resume/"):
        assert signed_in.get(f"/jobs/{job.pk}/{path}").status_code == 404
    assert csrf_post(signed_in, f"/jobs/{job.pk}/stop/").status_code == 404
    assert TrainingJob.objects.get(pk=job.pk).status == JobStatus.QUEUED
    assert adapter_name not in signed_in.get("/").content.decode()
    assert signed_in.get(f"/adapters/{adapter_name}/").status_code == 404
    staff = Client()
    staff.force_login(make_user("root", staff=True))
    assert staff.get(f"/jobs/{job.pk}/").status_code == 200
    assert adapter_name in staff.get("/").content.decode()


def test_a_404_keeps_the_dashboard_around_it(fake_runner, signed_in, bob, adapter_name):
    """Not Django's bare "Not Found" page: the navigation, what was not found, and the way back."""
    other = Client()
    other.force_login(bob)
    job = submitted(submit_form(other, adapter_name))
    for path, words in ((f"/jobs/{job.pk}/", "No such job (or it belongs to someone else)."),
                        (f"/adapters/{adapter_name}/", "No such adapter (or it belongs to someone else)."),
                        ("/no/such/page/", "There is nothing at")):
        response = signed_in.get(path)
        page = response.content.decode()
        assert response.status_code == 404 and "data-not-found" in page, page[:500]
        assert words in page and 'aria-label="Main"' in page and 'href="/"' in page


# -- jobs list --


def test_jobs_list_shows_filters_and_rows(fake_runner, signed_in, adapter_name):
    queued = submitted(submit_form(signed_in, adapter_name))
    done = submitted(submit_form(signed_in, adapter_name + "-done"))
    csrf_post(signed_in, f"/jobs/{queued.pk}/stop/")  # queued -> cancelled at once
    page = signed_in.get("/").content.decode()
    assert f'data-job="{queued.pk}"' in page and f'data-job="{done.pk}"' in page
    assert 'name="status"' in page and 'name="kind"' in page
    only_cancelled = signed_in.get("/", {"status": "cancelled"}).content.decode()
    assert f'data-job="{queued.pk}"' in only_cancelled and f'data-job="{done.pk}"' not in only_cancelled
    rows = signed_in.get("/jobs/rows", {"status": "queued"}).content.decode()
    assert f'data-job="{done.pk}"' in rows and f'data-job="{queued.pk}"' not in rows
    assert "<html" not in rows  # the table body only, for the page to swap in


# -- the new-job form --


@pytest.mark.parametrize("kind, schema", [("sft", SFTRequest), ("grpo", GRPORequest), ("opd", OPDRequest)])
def test_the_form_offers_every_field_of_the_api_schema(signed_in, kind, schema):
    page = signed_in.get(f"/jobs/new/{kind}/").content.decode()
    for path in schema_leaves(schema):
        name = "__".join(path[1:] if path[0] == "config" else path)
        assert f'name="{name}"' in page, name
    assert 'enctype="multipart/form-data"' in page and "csrfmiddlewaretoken" in page
    assert 'name="max_grad_norm__null"' in page  # null (no clipping) is not the same as blank (the default)
    assert all(f'href="/jobs/new/{other}/"' in page for other in ("sft", "grpo", "opd"))


def test_the_gate_suite_field_offers_the_person_s_own_suites(signed_in, ada, bob):
    from kiln_web.evals.actions import do_create_suite

    content = '{"prompt": "1+1", "expected": "2"}\n'
    do_create_suite(ada, "ada-held-out", content, "exact")
    do_create_suite(bob, "bob-held-out", content, "exact")
    page = signed_in.get("/jobs/new/sft/").content.decode()
    assert 'list="suggest-gate__suite"' in page
    offered = re.search(r'<datalist id="suggest-gate__suite">(.*?)</datalist>', page, re.S).group(1)
    assert '<option value="ada-held-out">' in offered and "bob-held-out" not in offered


def test_opd_prompts_may_be_strings_and_a_json_list(signed_in):
    from kiln_web.dashboard.forms import OPDJobForm

    for content in (b'"Say hi."\n{"prompt": "Say bye."}\n', b'["Say hi.", {"prompt": "Say bye."}]'):
        form = OPDJobForm({"output_name": "student", "teacher": "tutor@native", "stop_strings": "END\n###"},
                          {"prompts": SimpleUploadedFile("p.json", content)})
        assert form.is_valid(), form.errors
        assert form.body["prompts"] == ["Say hi.", {"prompt": "Say bye."}]
        assert form.body["config"]["stop_strings"] == ["END", "###"]
    form = SFTJobForm({"output_name": "x"}, {"data": SimpleUploadedFile("d.jsonl", b'"just a string"\n')})
    assert not form.is_valid() and form.errors["data"] == ["Line 1 is not a JSON object."]


def test_an_upload_is_read_as_jsonl_with_a_byte_order_mark_and_separators_inside_strings(signed_in):
    """Lines end at "\n" only: U+2028, U+2029 and U+0085 inside a JSON string (as json.dumps(ensure_ascii=False)
    writes them) did not end a line, and a Windows editor's byte-order mark is not part of the first record."""
    from kiln_web.dashboard.forms import OPDJobForm

    records = [{"prompt": f"a{separator}b", "completion": " c"} for separator in ("\u2028", "\u2029", "\u0085")]
    text = "\ufeff" + "".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in records)
    form = SFTJobForm({"output_name": "x"}, {"data": SimpleUploadedFile("d.jsonl", text.encode("utf-8"))})
    assert form.is_valid(), form.errors
    assert form.body["data"] == records
    form = OPDJobForm({"output_name": "student", "teacher": "tutor@native"},
                      {"prompts": SimpleUploadedFile("p.json", "\ufeff[\"Say hi.\"]".encode("utf-8"))})
    assert form.is_valid(), form.errors
    assert form.body["prompts"] == ["Say hi."]


def test_prepared_resume_keeps_the_promotion_the_job_asked_for():
    request = {"data": RECORDS, "config": {}, "auto_load": True, "gate": {"suite": "held-out", "min_accuracy": 0.5}}
    initial = SFTJobForm.initial_from({"output_name": "bot"}, request, "bot-checkpoint-step-00000002.kiln-checkpoint")
    assert initial["auto_load"] == "true" and initial["gate__suite"] == "held-out"
    assert initial["gate__min_accuracy"] == 0.5 and "data" not in initial


def test_prepared_resume_never_carries_inline_records():
    from kiln_web.dashboard.forms import JOB_FORMS

    for kind, form_class in JOB_FORMS.items():
        request = {"data": RECORDS, "groups": RECORDS, "prompts": ["p"], "config": {}}
        initial = form_class.initial_from({"output_name": "bot", "seed": 3}, request, "bot-checkpoint-step-00000002"
                                          ".kiln-checkpoint")
        assert initial["output_name"] == "bot" and initial["seed"] == 3 and initial["resume_checkpoint"]
        assert not set(initial) & {"data", "groups", "prompts"}, kind


def test_submit_an_upload_with_nested_fields(fake_runner, signed_in, adapter_name):
    job = submitted(submit_form(signed_in, adapter_name, epochs="2", learning_rate="0.0003", lora__rank="4",
                                lora__targets="q_proj, v_proj", lr_schedule__type="cosine",
                                checkpoint_interval="2", seed="7", max_grad_norm__null="on"))
    assert job.status == JobStatus.QUEUED and job.data_source_kind == "inline"
    assert job.request == {"data": RECORDS, "config": {
        "output_name": adapter_name, "epochs": 2, "learning_rate": 0.0003, "lora": {"rank": 4, "targets": [
            "q_proj", "v_proj"]}, "lr_schedule": {"type": "cosine"}, "checkpoint_interval": 2, "seed": 7,
        "max_grad_norm": None}}
    assert job.effective_seed == 7 and job.total_steps == 8


def test_submit_a_dataset_path(fake_runner, signed_in, adapter_name):
    path = settings.KILN_DATASETS_DIR / f"{adapter_name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    job = submitted(csrf_post(signed_in, "/jobs/new/sft/", {"output_name": adapter_name,
                                                            "dataset_path": str(path)}))
    assert job.data_source_kind == "file" and job.request["dataset_path"] == str(path)


def field_errors(page: str, name: str) -> list[str]:
    block = re.search(r'data-field="' + name + r'">(.*?)</div>', page, re.S)
    assert block, name
    return re.findall(r'class="field-error"[^>]*>(.*?)</p>', block.group(1), re.S)


@pytest.mark.parametrize("fields, name, words", [
    ({"epochs": "0"}, "epochs", "greater than or equal to 1"),
    ({"learning_rate": "0"}, "learning_rate", "greater than 0"),
    ({"output_name": "no spaces"}, "output_name", "starting with a letter or digit; no spaces"),  # not a regex
    ({"quantization__block_size": "64"}, "quantization__type", "required"),
    ({"base_model": "bad-request"}, "base_model", "not acceptable"),  # the trainer's RequestError
    ({"resume_checkpoint": "../escape"}, "resume_checkpoint", ""),  # a checkpoint refusal from admission
])
def test_refusals_land_next_to_their_fields(fake_runner, signed_in, adapter_name, fields, name, words):
    response = submit_form(signed_in, adapter_name, **fields)
    assert response.status_code == 400
    errors = field_errors(response.content.decode(), name)
    assert errors and words in " ".join(errors), errors
    assert not TrainingJob.objects.exists()


def test_source_is_required_and_single(fake_runner, signed_in, adapter_name):
    page = csrf_post(signed_in, "/jobs/new/sft/", {"output_name": adapter_name})
    assert page.status_code == 400
    assert "Upload a JSONL file or give a dataset path" in " ".join(field_errors(page.content.decode(), "data"))
    both = submit_form(signed_in, adapter_name, dataset_path="/x.jsonl")
    assert "not both" in " ".join(field_errors(both.content.decode(), "data"))
    blank = SimpleUploadedFile("blank.jsonl", b"\n\n")
    bad = csrf_post(signed_in, "/jobs/new/sft/", {"output_name": adapter_name, "data": blank})
    assert field_errors(bad.content.decode(), "data") == ["The file holds no records."]
    broken = SimpleUploadedFile("broken.jsonl", b'{"prompt": "q"}\n{oops\n')
    bad = csrf_post(signed_in, "/jobs/new/sft/", {"output_name": adapter_name, "data": broken})
    assert "Line 2 is not JSON" in field_errors(bad.content.decode(), "data")[0]
    assert not TrainingJob.objects.exists()


def test_admission_refusal_without_a_field_is_shown_above_the_form(fake_runner, signed_in, adapter_name):
    response = submit_form(signed_in, adapter_name, base_model="missing")
    assert response.status_code == 400
    page = response.content.decode()
    assert 'data-refusal="base_not_found"' in page and "no base named" in page
    # ... and at the field its code concerns, linked from above, never a third time as a form-wide error
    assert "no base named" in " ".join(field_errors(page, "base_model"))
    assert 'data-refusal-at="base_model"' in page and 'href="#id_base_model"' in page
    assert page.count("no base named") == 2


def test_auto_load_and_the_gate_are_promotion_not_data(fake_runner, signed_in, ada, adapter_name):
    """auto_load sits beside config in the request, as the data does, but it is no data source: an upload with
    auto_load was refused as "Give one data source, not both", and auto_load alone counted as the data."""
    from kiln_web.evals.actions import do_create_suite

    do_create_suite(ada, "held-out", '{"prompt": "q", "expected": "a"}\n')
    form = signed_in.get("/jobs/new/sft/").content.decode()
    data = re.search(r"<legend>Data</legend>(.*?)</fieldset>", form, re.S).group(1)
    promotion = re.search(r"<legend>Promotion</legend>(.*?)</fieldset>", form, re.S).group(1)
    assert 'name="auto_load"' not in data and 'name="auto_load"' in promotion and 'name="gate__suite"' in promotion
    job = submitted(submit_form(signed_in, adapter_name, auto_load="true", gate__suite="held-out",
                                gate__min_accuracy="0.5"))
    assert job.request["auto_load"] is True and job.request["gate"] == {"suite": "held-out", "min_accuracy": 0.5}
    assert job.request["data"] == RECORDS
    alone = csrf_post(signed_in, "/jobs/new/sft/", {"output_name": adapter_name, "auto_load": "true"})
    assert alone.status_code == 400
    assert "Upload a JSONL file or give a dataset path" in " ".join(field_errors(alone.content.decode(), "data"))


def test_a_refused_record_of_an_upload_is_shown_at_the_upload(signed_in, adapter_name):
    bad = json.dumps({"prompt": "Say kiln.", "completions": ["KILN!", "no"], "rewards": [1.0, 0.0]}) + "\n"
    response = csrf_post(signed_in, "/jobs/new/grpo/", {"output_name": adapter_name,
                                                       "groups": SimpleUploadedFile("g.jsonl", bad.encode())})
    assert response.status_code == 400
    errors = field_errors(response.content.decode(), "groups")
    assert errors == ["Line 1, completions[0]: must be an object with a text string"], errors
    assert not TrainingJob.objects.exists()


def test_a_refused_record_of_an_upload_is_named_by_its_line_as_the_api_names_a_file_s(signed_in, adapter_name):
    """Admission names an uploaded record by its index among the records (groups[1]); the page said "Record 2",
    which is not where an editor shows it when blank lines come before it. It names the line, as a dataset_path's
    refusal and the upload's own "Line 4 is not JSON" do (a JSON list's item by its number)."""
    good = {"prompt": "Say kiln.", "completions": [{"text": "KILN!", "reward": 1.0}, {"text": "no", "reward": 0.0}]}
    bad = {"prompt": "Say kiln.", "completions": ["KILN!", "no"]}
    text = "\n" + json.dumps(good) + "\n\n" + json.dumps(bad) + "\n"
    response = csrf_post(signed_in, "/jobs/new/grpo/", {"output_name": adapter_name,
                                                       "groups": SimpleUploadedFile("g.jsonl", text.encode())})
    assert field_errors(response.content.decode(), "groups") == [
        "Line 4, completions[0]: must be an object with a text string"]
    listed = SimpleUploadedFile("g.json", json.dumps([good, bad]).encode())
    response = csrf_post(signed_in, "/jobs/new/grpo/", {"output_name": adapter_name, "groups": listed})
    assert field_errors(response.content.decode(), "groups") == [
        "Item 2, completions[0]: must be an object with a text string"]
    assert not TrainingJob.objects.exists()


def test_a_refusal_at_a_fieldset_lands_on_the_field_it_names(signed_in, adapter_name):
    response = submit_form(signed_in, adapter_name, lora__targets="q_proj, bogus")
    assert response.status_code == 400
    page = response.content.decode()
    assert "are not projections" in " ".join(field_errors(page, "lora__targets"))
    assert not field_errors(page, "lora__rank")


def test_a_refused_form_says_so_at_the_top_and_links_each_field(signed_in, adapter_name):
    """The form is long: an error at its end (Checkpoint interval) was below the fold, and the page came back
    looking unchanged. A summary above the form links each field; each field's aria-describedby resolves."""
    response = submit_form(signed_in, adapter_name, epochs="0", checkpoint_interval="0")
    assert response.status_code == 400
    page = response.content.decode()
    summary = re.search(r"<section[^>]*data-error-summary>(.*?)</section>", page, re.S)
    assert summary, page[:3000]
    links = re.findall(r'<a href="#(id_[a-z_]+)">([^<]+)</a>', summary.group(1))
    assert links == [("id_epochs", "Epochs"), ("id_checkpoint_interval", "Checkpoint interval")], links
    ids = set(re.findall(r'\bid="([^"]+)"', page))
    described = {name for value in re.findall(r'aria-describedby="([^"]+)"', page) for name in value.split()}
    assert described and described <= ids, sorted(described - ids)
    assert "data-error-summary" not in signed_in.get("/jobs/new/sft/").content.decode()

    # an error of the whole form (no field to mark) is said once, without an empty summary
    from django.template.loader import render_to_string

    from kiln_web.dashboard.forms import TeacherForm

    form = TeacherForm({"name": "tutor@native"})
    assert form.is_valid()
    form.add_error(None, "the whole form")
    shown = render_to_string("dashboard/_form_errors.html", {"form": form})
    assert "the whole form" in shown and "data-error-summary" not in shown


def test_a_form_shown_again_asks_for_its_file_again(fake_runner, signed_in, adapter_name):
    """A browser never refills a file input: after any refusal the upload field names the file to choose again,
    and a broken file is reported together with the other fields' errors, not on the next try."""
    broken = SimpleUploadedFile("broken.jsonl", b'{"prompt": "q", "completion": "a"}\n{oops\n')
    page = csrf_post(signed_in, "/jobs/new/sft/", {"output_name": adapter_name, "epochs": "0", "data": broken})
    assert page.status_code == 400
    page = page.content.decode()
    assert field_errors(page, "epochs") and "Line 2 is not JSON" in " ".join(field_errors(page, "data"))
    assert re.search(r"data-choose-again>Choose <span[^>]*>broken.jsonl</span> again", page)
    assert "data-choose-again" not in signed_in.get("/jobs/new/sft/").content.decode()


# -- job detail, Stop and save --


def cancelled_job(client, monkeypatch, adapter, at_step=2, **fields):
    job = submitted(submit_form(client, adapter, checkpoint_interval="2", seed="11", **fields))
    cancel_at(monkeypatch, at_step)
    run_queued()
    monkeypatch.undo()
    job.refresh_from_db()
    return job


def test_job_detail_shows_progress_checkpoint_config_and_promotion(fake_runner, signed_in, adapter_name):
    job = submitted(submit_form(signed_in, adapter_name, checkpoint_interval="2", seed="5"))
    run_queued()
    page = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    basename = f"{adapter_name}-checkpoint-step-00000004.kiln-checkpoint"
    assert "Step 4 of 4" in page and "status-succeeded" in page
    assert f'data-copy="{basename}"' in page and 'data-resume-kind="exact"' in page
    assert "complete: the run had finished" in page and "epoch 1, example 0" in page
    assert page.count('data-state="valid"') == 2  # steps 2 and 4, each light-validated now
    assert 'data-promotion="not_requested"' in page and "Not requested" in page
    assert 'data-trained="yes"' in page
    assert "effective seed" in page and ">5<" in page and "inline" in page
    charts = json.loads(re.search(r'id="kiln-metrics" type="application/json">(.*?)</script>', page).group(1))
    assert [m["step"] for m in charts] == [1, 2, 3, 4] and charts[0]["loss"] == 1.0
    assert "Prepare resume" not in page  # the run completed: nothing to resume


def test_stop_and_save_shows_the_confirmed_step(fake_runner, signed_in, adapter_name, monkeypatch):
    job = submitted(submit_form(signed_in, adapter_name, checkpoint_interval="10", seed="3"))
    # the worker claims it; the person presses Stop while it runs
    from kiln_web.jobs import actions

    assert actions.do_claim_job(job.pk, "test-worker")
    response = csrf_post(signed_in, f"/jobs/{job.pk}/stop/")
    assert response.status_code == 302 and response["Location"] == f"/jobs/{job.pk}/"
    job.refresh_from_db()
    assert job.status == JobStatus.CANCELLING
    page = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    assert 'data-stop-state="pending"' in page and "Stopped and saved" not in page

    job = cancelled_job(signed_in, monkeypatch, adapter_name + "-b", at_step=3)
    assert job.status == JobStatus.CANCELLED and job.committed_step == 3
    page = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    assert 'data-stop-state="confirmed" data-stop-step="3"' in page and "Stopped and saved at step 3 of 4" in page
    assert "Prepare resume" in page


def test_a_damaged_checkpoint_never_shows_as_saved(fake_runner, signed_in, adapter_name, monkeypatch):
    job = cancelled_job(signed_in, monkeypatch, adapter_name, at_step=3)
    path = settings.KILN_ADAPTERS_DIR / job.latest_checkpoint["resume_checkpoint"]
    (path / "state.json").write_text("tampered, longer than before")
    page = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    assert 'data-stop-state="invalid"' in page and "Stopped and saved" not in page
    assert "size_mismatch" in page and "Prepare resume" not in page
    shutil.rmtree(path)
    page = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    assert "Stopped and saved" not in page and 'data-state="missing"' in page


def test_a_deleted_run_s_job_does_not_show_a_fresh_run_s_checkpoint_as_its_own(fake_runner, signed_in, adapter_name,
                                                                               monkeypatch):
    """The adapter deleted and trained afresh: the old job's checkpoint name holds the fresh run's checkpoint now.
    The old job's panel showed it as saved, valid, and offered Prepare resume from it."""
    from kiln_web.serving.actions import do_delete_adapter

    old = cancelled_job(signed_in, monkeypatch, adapter_name, at_step=3)
    do_delete_adapter(old.owner, adapter_name)
    fresh = submitted(submit_form(signed_in, adapter_name, checkpoint_interval="2", seed="12"))
    cancel_at(monkeypatch, 3)
    run_queued()
    monkeypatch.undo()
    fresh.refresh_from_db()
    assert fresh.latest_checkpoint["resume_checkpoint"] == old.latest_checkpoint["resume_checkpoint"]

    page = signed_in.get(f"/jobs/{old.pk}/").content.decode()
    assert 'data-stop-state="invalid"' in page and "Stopped and saved" not in page
    assert "checkpoint_changed" in page and "Prepare resume" not in page
    page = signed_in.get(f"/jobs/{fresh.pk}/").content.decode()
    assert "Stopped and saved at step 3 of 4" in page and "Prepare resume" in page


def test_a_stop_after_the_last_checkpoint_says_how_far_behind(fake_runner, signed_in, adapter_name, monkeypatch,
                                                              settings):
    # no checkpointing at all (the server default turned off): stopped, nothing saved, not resumable
    settings.KILN_CHECKPOINT_INTERVAL = None
    job = submitted(submit_form(signed_in, adapter_name, seed="3"))
    cancel_at(monkeypatch, 2)
    run_queued()
    monkeypatch.undo()
    page = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    assert 'data-stop-state="none"' in page and "Stopped and saved" not in page


def test_failed_job_shows_its_error(fake_runner, signed_in, adapter_name):
    records = RECORDS[:2] + [{"fail": "boom"}]
    job = submitted(csrf_post(signed_in, "/jobs/new/sft/", {"output_name": adapter_name, "data": upload(records),
                                                            "checkpoint_interval": "1"}))
    run_queued()
    page = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    assert "Failed: internal_error" in page and "boom" in page
    assert "Stopped and saved" not in page and 'data-trained="no"' in page


def test_snapshot_returns_state_new_steps_and_panels(fake_runner, signed_in, adapter_name, monkeypatch):
    job = cancelled_job(signed_in, monkeypatch, adapter_name, at_step=3)
    snapshot = signed_in.get(f"/jobs/{job.pk}/snapshot", {"after_step": 1}).json()
    assert snapshot["job"]["status"] == "cancelled" and snapshot["job"]["committed_step"] == 3
    assert [m["step"] for m in snapshot["metrics"]] == [2, 3]
    # what the charts and the ETA use, nothing more (tokens/s is derived from tokens and elapsed_seconds)
    assert set(snapshot["metrics"][0]) == {"step", "loss", "elapsed_seconds", "learning_rate", "grad_norm", "tokens"}
    panels = snapshot["panels"]
    assert 'data-stop-state="confirmed"' in panels["stop"] and "Prepare resume" in panels["actions"]
    assert "csrfmiddlewaretoken" not in panels["actions"] or "Stop" in panels["actions"]
    assert job.latest_checkpoint["resume_checkpoint"] in panels["checkpoint"]
    assert "published" in panels["events"]


# -- prepare resume --


def test_prepare_resume_prefills_and_clears_inline_data(fake_runner, signed_in, adapter_name, monkeypatch):
    job = cancelled_job(signed_in, monkeypatch, adapter_name, at_step=3, epochs="2", learning_rate="0.0003",
                        lora__targets="q_proj, v_proj")
    basename = job.latest_checkpoint["resume_checkpoint"]
    assert basename.endswith("-checkpoint-step-00000003.kiln-checkpoint")
    response = signed_in.get(f"/jobs/{job.pk}/resume/")
    assert response.status_code == 200
    form = response.context["form"]
    assert form.initial["resume_checkpoint"] == basename
    assert form.initial["output_name"] == adapter_name and form.initial["epochs"] == 2
    assert form.initial["learning_rate"] == 0.0003 and form.initial["seed"] == 11
    assert form.initial["checkpoint_interval"] == 2
    assert "data" not in form.initial and "dataset_path" not in form.initial
    page = response.content.decode()
    assert f'value="{basename}"' in page and "data-source-cleared" in page


def resume_fields(form: SFTJobForm) -> dict:
    """What the browser sends back for a prefilled form (every initial value, unchanged)."""
    return {name: ("on" if value is True else value) for name, value in form.initial.items()}


def test_prepare_resume_refuses_without_the_source_then_resumes(fake_runner, signed_in, adapter_name, monkeypatch):
    job = cancelled_job(signed_in, monkeypatch, adapter_name, at_step=3)
    fields = resume_fields(signed_in.get(f"/jobs/{job.pk}/resume/").context["form"])
    refused = csrf_post(signed_in, f"/jobs/{job.pk}/resume/", fields)
    assert refused.status_code == 400
    assert "Supply the training data again" in " ".join(field_errors(refused.content.decode(), "data"))
    assert TrainingJob.objects.count() == 1

    resumed = submitted(csrf_post(signed_in, f"/jobs/{job.pk}/resume/", {**fields, "data": upload()}))
    assert resumed.resume_from == job.latest_checkpoint["resume_checkpoint"]
    assert resumed.effective_seed == job.effective_seed
    run_queued()
    resumed.refresh_from_db()
    assert resumed.status == JobStatus.SUCCEEDED and resumed.committed_step == 4
    assert list(JobMetric.objects.filter(job=resumed).values_list("step", flat=True)) == [4]
    # the resumed run's charts start at step 1: the earlier run's steps up to the checkpoint come first
    page = signed_in.get(f"/jobs/{resumed.pk}/").content.decode()
    earlier = json.loads(re.search(r'id="kiln-earlier" type="application/json">(.*?)</script>', page).group(1))
    assert [m["step"] for m in earlier] == [1, 2, 3]


def test_prepare_resume_shows_drift_as_a_table(fake_runner, signed_in, adapter_name, monkeypatch):
    job = cancelled_job(signed_in, monkeypatch, adapter_name, at_step=3)
    fields = resume_fields(signed_in.get(f"/jobs/{job.pk}/resume/").context["form"])
    response = csrf_post(signed_in, f"/jobs/{job.pk}/resume/", {**fields, "learning_rate": "0.01",
                                                                "seed": "12", "data": upload()})
    assert response.status_code == 409
    page = response.content.decode()
    assert 'data-refusal="resume_drift"' in page
    table = re.search(r"<table[^>]*data-drift>(.*?)</table>", page, re.S).group(1)
    assert re.findall(r"<th(?:\s[^>]*)?>(.*?)</th>", table)[:3] == ["Field", "Checkpoint value", "Request value"]
    cells = [[re.sub(r"<[^>]+>", "", cell).strip() for cell in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row, re.S)]
             for row in re.findall(r"<tr>(.*?)</tr>", table, re.S)[1:]]
    assert ["config.learning_rate", "0.0002", "0.01"] in cells and ["seed", "11", "12"] in cells
    assert TrainingJob.objects.count() == 1


def test_prepare_resume_keeps_a_dataset_path(fake_runner, signed_in, adapter_name, monkeypatch):
    path = settings.KILN_DATASETS_DIR / f"{adapter_name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    job = submitted(csrf_post(signed_in, "/jobs/new/sft/", {"output_name": adapter_name, "dataset_path": str(path),
                                                            "checkpoint_interval": "2"}))
    cancel_at(monkeypatch, 2)
    run_queued()
    monkeypatch.undo()
    form = signed_in.get(f"/jobs/{job.pk}/resume/").context["form"]
    assert form.initial["dataset_path"] == str(path)
    resumed = submitted(csrf_post(signed_in, f"/jobs/{job.pk}/resume/", resume_fields(form)))
    assert resumed.resume_from and resumed.data_source_kind == "file"


def test_prepare_resume_needs_a_resumable_checkpoint(fake_runner, signed_in, adapter_name):
    job = submitted(submit_form(signed_in, adapter_name, checkpoint_interval="2"))
    response = signed_in.get(f"/jobs/{job.pk}/resume/")  # still queued
    assert response.status_code == 302 and response["Location"] == f"/jobs/{job.pk}/"


# -- adapters --


def test_adapters_pages_show_snapshots_and_checkpoints(fake_runner, signed_in, adapter_name, monkeypatch):
    job = cancelled_job(signed_in, monkeypatch, adapter_name, at_step=3)
    snapshot = settings.KILN_ADAPTERS_DIR / adapter_name
    snapshot.mkdir()
    (snapshot / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                              "target_modules": ["q_proj"]}))
    (snapshot / "adapter_model.safetensors").write_bytes(b"\0" * 2048)
    listing = signed_in.get("/adapters/").content.decode()
    assert adapter_name in listing and "2 valid" in listing and "present" in listing
    page = signed_in.get(f"/adapters/{adapter_name}/").content.decode()
    assert "Weights-only warm start (PEFT snapshot)" in page and "2.0 KiB" in page
    assert page.count('data-state="valid"') == 2 and f'data-job="{job.pk}"' in page
    monkeypatch.setattr("kiln_web.dashboard.readers.VALIDATE_LIMIT", 1)  # only the newest is checked per view
    page = signed_in.get(f"/adapters/{adapter_name}/").content.decode()
    assert page.count('data-state="valid"') == 1 and page.count('data-state="unchecked"') == 1
    monkeypatch.undo()
    # a run without a valid checkpoint but with a snapshot: only a warm start is offered
    for path in settings.KILN_ADAPTERS_DIR.glob(f"{adapter_name}-checkpoint-step-*"):
        shutil.rmtree(path)
    detail = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    assert 'data-resume-kind="warm"' in detail and 'data-resume-kind="exact"' not in detail


def test_pages_render_for_an_empty_installation(signed_in):
    assert "No jobs here yet" in signed_in.get("/").content.decode()
    assert "No adapters yet" in signed_in.get("/adapters/").content.decode()


# -- the admin --


def test_every_kiln_model_is_in_the_admin_with_working_lists(django_user_model):
    staff = Client()
    staff.force_login(django_user_model.objects.create_superuser("root", password=None))
    models = [m for m in apps.get_models() if m.__module__.startswith("kiln_web.")]
    assert models
    for model in models:
        assert admin.site.is_registered(model), model
        model_admin = admin.site._registry[model]
        assert model_admin.list_display != ("__str__",), model
        assert model_admin.search_fields, model
        url = f"/admin/{model._meta.app_label}/{model._meta.model_name}/"
        assert staff.get(url, {"q": "x"}).status_code == 200, url



# -- teachers --


def test_teachers_page_registers_lists_and_deletes(signed_in, bob):
    page = signed_in.get("/teachers/")
    assert page.status_code == 200 and "No teacher aliases yet" in page.content.decode()
    refused = csrf_post(signed_in, "/teachers/", {"name": "no-route", "base": "kiln-tiny"})
    assert refused.status_code == 400 and field_errors(refused.content.decode(), "name")
    created = csrf_post(signed_in, "/teachers/", {"name": "tutor@native", "base": "kiln-tiny"})
    assert created.status_code == 302
    again = csrf_post(signed_in, "/teachers/", {"name": "tutor@native", "base": "kiln-tiny"})
    assert again.status_code == 400 and "already exists" in " ".join(field_errors(again.content.decode(), "name"))
    page = signed_in.get("/teachers/").content.decode()
    assert 'data-teacher="tutor@native"' in page and "Delete" in page
    assert "tutor@native" in signed_in.get("/jobs/new/opd/").content.decode()  # offered in the OPD form
    other = Client()
    other.force_login(bob)
    assert "Delete" not in other.get("/teachers/").content.decode()
    csrf_post(other, "/teachers/tutor@native/delete/")
    assert 'data-teacher="tutor@native"' in signed_in.get("/teachers/").content.decode()  # not bob's to delete
    csrf_post(signed_in, "/teachers/tutor@native/delete/")
    assert 'data-teacher="tutor@native"' not in signed_in.get("/teachers/").content.decode()


def test_trained_and_promoted_are_shown_apart(fake_runner, signed_in, ada, adapter_name):
    from kiln_web.evals.models import EvalRun, EvalSuite
    from kiln_web.serving.models import PromotionRecord

    job = submitted(submit_form(signed_in, adapter_name, checkpoint_interval="2"))
    run_queued()
    job.refresh_from_db()
    suite = EvalSuite.objects.create(name="held-out", owner=ada, content="", digest="d" * 64, example_count=16)
    evaluation = EvalRun.objects.create(
        owner=ada, suite=suite, suite_digest=suite.digest, candidate=job.adapter, candidate_base="kiln-tiny",
        baseline_kind="base", baseline="kiln-tiny", baseline_base="kiln-tiny", training_job=job, purpose="gate",
        status="running")
    page = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    assert 'data-trained="yes"' in page and 'data-promotion="pending"' in page and "held-out" in page

    EvalRun.objects.filter(pk=evaluation.pk).update(
        status="succeeded", candidate_summary={"correct": 9, "total": 16, "accuracy": 0.5625},
        baseline_summary={"correct": 10, "total": 16, "accuracy": 0.625})
    PromotionRecord.objects.create(adapter=job.adapter, job=job, evaluation=evaluation, outcome="gate_failed",
                                   reason="accuracy 56.2% is below the baseline's 62.5%", decided_by="gate")
    page = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    assert 'data-trained="yes"' in page  # still trained: the gate decides promotion, not training
    assert 'data-promotion="gate_failed"' in page and "Gate failed" in page and "below the baseline" in page
    assert "candidate 56.2% vs kiln-tiny 62.5% on 16 examples" in page
    assert f'href="/evals/runs/{evaluation.pk}/" data-eval-link' in page  # each run links to its page
    assert signed_in.get(f"/evals/runs/{evaluation.pk}/").status_code == 200


RATES = ["learning_rate", "grad_norm", "tokens_per_second"]


@pytest.mark.parametrize("kind, metrics, charts", [
    ("grpo", {"loss": 0.1, "reward_mean": 0.5, "kl_mean": 0.01, "clip_region_fraction": 0.2},
     ["loss", "reward_mean", "kl_mean", "clip_region_fraction"] + RATES),
    ("opd", {"loss": 0.3, "kl": 0.3, "entropy": 2.0}, ["kl"] + RATES),
])
def test_grpo_and_opd_pages_draw_their_own_charts(signed_in, ada, kind, metrics, charts):
    from kiln_web.adapters.models import Adapter

    identities = {"teacher": {"alias": "tutor@native", "route": "native", "identity_revision": "a" * 64,
                              "content_revision": "b" * 64}} if kind == "opd" else {}
    adapter = Adapter.objects.create(name=f"{kind}-bot", owner=ada)
    job = TrainingJob.objects.create(owner=ada, kind=kind, adapter=adapter, request={}, admission={},
                                     identities=identities, status=JobStatus.RUNNING, committed_step=1, total_steps=10)
    JobMetric.objects.create(job=job, step=1, metrics={**metrics, "elapsed_seconds": 0.5, "grad_norm": 1.0})
    page = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    assert re.findall(r'data-chart="([a-z_]+)"', page) == charts
    points = json.loads(re.search(r'id="kiln-metrics" type="application/json">(.*?)</script>', page).group(1))
    assert points == [{"step": 1, "elapsed_seconds": 0.5, "grad_norm": 1.0, **{key: metrics[key] for key in charts
                                                                               if key in metrics}}]
    specs = json.loads(re.search(r'id="kiln-charts" type="application/json">(.*?)</script>', page).group(1))
    assert {spec["key"]: spec["floor"] for spec in specs}["grad_norm"] == 0
    if kind == "opd":
        assert "tutor@native (native)" in page and "teacher identity revision" in page and "b" * 64 in page


# -- Stop without checkpointing, promotion before a decision, advice per kind --


def test_stop_asks_to_confirm_when_the_run_cannot_save(fake_runner, signed_in, adapter_name, settings):
    from kiln_web.jobs import actions

    settings.KILN_CHECKPOINT_INTERVAL = None
    job = submitted(submit_form(signed_in, adapter_name, seed="3"))
    assert job.effective_config["checkpoint_interval"] is None
    assert actions.do_claim_job(job.pk, "test-worker")
    page = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    assert "Stop (no checkpoint)" in page and "Stop and save" not in page
    assert 'name="confirm" value="1"' in page and "Stop without saving" in page

    # the plain POST (the first press, or a form without the confirmation) stops nothing
    response = csrf_post(signed_in, f"/jobs/{job.pk}/stop/")
    assert response.status_code == 302 and response["Location"] == f"/jobs/{job.pk}/"
    job.refresh_from_db()
    assert job.status == JobStatus.RUNNING
    page = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    assert "Not stopped: checkpointing is off for this run" in page

    response = csrf_post(signed_in, f"/jobs/{job.pk}/stop/", {"confirm": "1"})
    job.refresh_from_db()
    assert job.status == JobStatus.CANCELLING
    page = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    assert "Stopping without a checkpoint" in page and "publishes a checkpoint" not in page


def test_a_run_that_can_save_keeps_stop_and_save(fake_runner, signed_in, adapter_name):
    from kiln_web.jobs import actions

    job = submitted(submit_form(signed_in, adapter_name, seed="3"))  # the server default: every 50 steps
    assert job.effective_config["checkpoint_interval"] == 50
    assert actions.do_claim_job(job.pk, "test-worker")
    page = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    assert "Stop and save" in page and "Stop (no checkpoint)" not in page and 'name="confirm"' not in page


def job_asking(ada, name: str, request: dict, status=JobStatus.RUNNING, kind="sft") -> TrainingJob:
    from kiln_web.adapters.models import Adapter

    adapter = Adapter.objects.create(name=name, owner=ada)
    return TrainingJob.objects.create(owner=ada, kind=kind, adapter=adapter, request=request, admission={},
                                      status=status, committed_step=1, total_steps=10)


GATE = {"suite": "held-out", "min_accuracy": 0.5}


@pytest.mark.parametrize("request_body, status, state, label", [
    ({"auto_load": True, "gate": GATE}, JobStatus.QUEUED, "pending", "Awaiting the gate"),
    ({"auto_load": True, "gate": GATE}, JobStatus.RUNNING, "pending", "Awaiting the gate"),
    ({"auto_load": True, "gate": GATE}, JobStatus.SUCCEEDED, "pending", "Awaiting the gate"),
    ({"auto_load": True}, JobStatus.RUNNING, "pending_canary", "Awaiting the canary"),
    ({"auto_load": True, "gate": GATE}, JobStatus.FAILED, "not_trained", "Not promoted"),
    ({}, JobStatus.RUNNING, "not_requested", "Not requested"),
    ({"auto_load": False}, JobStatus.SUCCEEDED, "not_requested", "Not requested"),
])
def test_promotion_before_a_decision_follows_the_request(signed_in, ada, request_body, status, state, label):
    job = job_asking(ada, "asking-bot", request_body, status)
    page = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    assert f'data-promotion="{state}"' in page and label in page
    if state == "pending" and status != JobStatus.SUCCEEDED:
        assert "evaluated on suite held-out (min accuracy 0.5)" in page
    snapshot = signed_in.get(f"/jobs/{job.pk}/snapshot").json()
    assert f'data-promotion="{state}"' in snapshot["panels"]["outcome"]


@pytest.mark.parametrize("kind, advised", [("sft", True), ("grpo", True), ("opd", True)])
def test_base_adapter_advice_only_for_kinds_that_take_it(signed_in, ada, kind, advised):
    # every kind takes base_adapter now; the advice follows the kind's defaults (readers.accepts_base_adapter)
    job = job_asking(ada, f"{kind}-warm", {}, JobStatus.SUCCEEDED, kind=kind)
    snapshot = settings.KILN_ADAPTERS_DIR / job.adapter.name
    snapshot.mkdir(parents=True)
    (snapshot / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    page = signed_in.get(f"/jobs/{job.pk}/").content.decode()
    assert "data-snapshot-advice" in page
    assert ("base_adapter" in page) is advised
    assert ("Weights-only warm start" in page) is advised


def test_prepared_opd_resume_fills_the_teacher_alias_not_its_resolved_spec(ada, signed_in, monkeypatch):
    # the effective configuration holds the resolved teacher spec (a dict); the form must get the alias as
    # submitted, so the prepared request validates (it once showed the dict's Python repr)
    from kiln_web.jobs import runtime

    job = job_asking(ada, "distilled", {"prompts": ["p"], "config": {"output_name": "distilled",
                                                                     "teacher": "big@native"}},
                     status=JobStatus.CANCELLED, kind="opd")
    job.effective_config = {"output_name": "distilled", "steps": 10, "checkpoint_interval": 5,
                            "teacher": {"alias": "big@native", "route": "native", "base": "kiln-tiny"}}
    job.effective_seed = 9
    job.latest_checkpoint = {"resume_checkpoint": "distilled-checkpoint-step-00000005.kiln-checkpoint"}
    job.save()
    monkeypatch.setattr(runtime, "read_checkpoint_summary", lambda basename, kind, adapter, manifest_digest="": (
        {"complete": False, "committed_step": 5}, None))
    page = signed_in.get(f"/jobs/{job.pk}/resume/").content.decode()
    teacher = re.search(r'name="teacher"[^>]*value="([^"]*)"|value="([^"]*)"[^>]*name="teacher"', page)
    assert teacher is not None and "big@native" in teacher.group(0), page[:2000]
    assert "{&#x27;alias&#x27;" not in page and "'alias'" not in page
    assert "distilled-checkpoint-step-00000005.kiln-checkpoint" in page


# -- the first-run card --


def test_the_first_run_card_is_each_persons_own(make_user):
    """Adapter names are global, so a second person copying the first person's command gets adapter_name_taken;
    each card names an adapter of its reader's and says how to get a token of their own."""
    for username, adapter in (("bob", "first-bob"), ("carol.o+x@example.org", "first-carol.o-x-example.org")):
        client = Client()
        client.force_login(make_user(username))
        page = client.get("/").content.decode()
        assert f"--adapter {adapter} --auto-load --wait" in page, page
        assert f'"model": "{adapter}"' in page
        assert f"kiln token create --user {username}" in page
        assert "--adapter first " not in page and "kiln up</code> printed" not in page
