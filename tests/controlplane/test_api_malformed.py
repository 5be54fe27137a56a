"""Malformed input to every /v1/ endpoint is refused with a coded 4xx error that names the field, never a 500 and
never accepted to fail later in a worker: values Python's json reads but no JSON value is (NaN, Infinity), text no
database keeps or no tokenizer takes (NUL, unpaired surrogate escapes), bodies nested past the parser's depth, and
NUL characters in path and query parameters (PostgreSQL refuses NUL in a query's text). The PostgreSQL pass runs
this file too: there NUL reached the database and was a 500.

Found by sending malformed requests to every endpoint (wrong JSON types, huge and non-finite numbers, bools for
ints, NUL and surrogates, long strings, nesting); the cases that were answered well are not repeated here, the
schema tests (tests/security/test_schemathesis.py) keep those."""

import json

import pytest
from django.test import Client

from controlplane.conftest import sft_body
from controlplane.rl_data import grpo_inline
from kiln_web.jobs.models import TrainingJob
from kiln_web.teachers.models import TeacherAlias

pytestmark = pytest.mark.django_db

INLINE = [{"prompt": "q", "completion": "a"}]
JOB = "00000000-0000-0000-0000-000000000000"  # the body is refused before the job is looked up


def _sft(**config) -> dict:
    return {"data": INLINE, "config": {"output_name": "malformed", **config}}


def coded(response, status: int, code: str = "invalid_request") -> dict:
    assert response.status_code == status, response.content[:300]
    assert response["Content-Type"].startswith("application/json"), response.content[:200]
    error = response.json()["error"]
    assert error["code"] == code and error["message"], error
    return error


def send(client: Client, method: str, path: str, text: str):
    return client.generic(method, path, data=text.encode(), content_type="application/json")


@pytest.fixture
def client(ada):
    return Client(raise_request_exception=False, HTTP_AUTHORIZATION=f"Bearer {ada.token}")


# (method, path, body as sent, the field named); json.dumps writes NaN and Infinity as Python's json reads them
NAN_BODIES = [
    ("POST", "/v1/train/sft", _sft(learning_rate=float("inf")), "config.learning_rate"),
    ("POST", "/v1/train/sft", {"data": [{"prompt": "q", "completion": "a", "score": float("nan")}],
                               "config": {"output_name": "x"}}, "data.0.score"),
    ("POST", "/v1/train/sft", {**_sft(), "gate": {"suite": "s", "min_accuracy": float("-inf")}, "auto_load": True},
     "gate.min_accuracy"),
    ("POST", "/v1/train/grpo", {"groups": [{"prompt": "p", "completions": [{"text": "a", "reward": float("nan")}]}],
                                "config": {"output_name": "x"}}, "groups.0.completions.0.reward"),
    ("POST", "/v1/train/opd", {"prompts": ["p"], "config": {"output_name": "x", "teacher": "t@openai",
                                                            "guardrails": {"kl_ceiling": float("nan")}}},
     "config.guardrails.kl_ceiling"),
    ("POST", f"/v1/train/jobs/{JOB}/resume", {"data": [{"prompt": "q", "completion": "a", "w": float("inf")}]},
     "data.0.w"),
]

NUL_BODIES = [
    ("POST", "/v1/train/sft", {"data": [{"prompt": "q\x00", "completion": "a"}], "config": {"output_name": "x"}},
     "data.0.prompt"),
    ("POST", "/v1/train/sft", _sft(base_adapter="/\x00"), "config.base_adapter"),
    ("POST", "/v1/train/sft", {**_sft(), "auto_load": True, "gate": {"suite": "s\x00", "min_accuracy": 0.5}},
     "gate.suite"),
    ("POST", "/v1/train/sft", {"data": [{"prompt": "q", "completion": "a", "n\x00": 1}],
                               "config": {"output_name": "x"}}, "data.0.n\x00"),
    ("POST", "/v1/train/grpo", {"groups": [{"prompt": "\x00", "completions": []}], "config": {"output_name": "x"}},
     "groups.0.prompt"),
    ("POST", "/v1/train/opd", {"prompts": ["p\x00"], "config": {"output_name": "x", "teacher": "t@openai"}},
     "prompts.0"),
    ("POST", "/v1/teachers", {"name": "t@native", "base": "kiln-tiny", "adapter": "/\x00"}, "adapter"),
    ("PUT", "/v1/teachers/t@openai", {"endpoint": "http://gpu-1:8000", "model": "m\x00"}, "model"),
    ("POST", "/v1/adapters/some-bot/shares", {"user": "\x00"}, "user"),
    ("POST", "/v1/adapters/some-bot/shares", {"group": "g\x00"}, "group"),
    ("POST", "/v1/adapters/some-bot/load", {"base": "\x00"}, "base"),
    ("POST", "/v1/evals/runs", {"adapter": "some-bot", "suite": "\x00"}, "suite"),
    ("POST", "/v1/evals/suites", {"name": "s", "content": '{"prompt": "a", "expected": "b"}\n\x00'}, "content"),
    ("POST", f"/v1/train/jobs/{JOB}/resume", {"dataset_path": "/\x00"}, "dataset_path"),
]

SURROGATE_TEXTS = [  # an unpaired surrogate escape only exists in the body's text: json.dumps would pair nothing
    ("POST", "/v1/train/sft", '{"data": [{"prompt": "q\\ud800", "completion": "a"}], "config": {"output_name": "x"}}',
     "data.0.prompt"),
    ("POST", "/v1/train/sft", '{"data": [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
                              '"content": "\\udfff"}]}], "config": {"output_name": "x"}}', "data.0.messages.1.content"),
    ("POST", "/v1/train/opd", '{"prompts": ["\\uD83D"], "config": {"output_name": "x", "teacher": "t@openai"}}',
     "prompts.0"),
]


@pytest.mark.parametrize("method, path, body, field", NAN_BODIES + NUL_BODIES,
                         ids=[f"{case[1]}:{case[3]}" for case in NAN_BODIES + NUL_BODIES])
def test_a_body_value_json_cannot_carry_is_refused_naming_its_field(client, method, path, body, field):
    jobs, teachers = TrainingJob.objects.count(), TeacherAlias.objects.count()
    error = coded(send(client, method, path, json.dumps(body)), 400)
    assert error["field"] == field and error["message"].startswith(f"{field}: "), error
    assert TrainingJob.objects.count() == jobs and TeacherAlias.objects.count() == teachers


@pytest.mark.parametrize("method, path, text, field", SURROGATE_TEXTS, ids=[case[3] for case in SURROGATE_TEXTS])
def test_an_unpaired_surrogate_escape_is_refused_naming_its_field(client, method, path, text, field):
    error = coded(send(client, method, path, text), 400)
    assert error["field"] == field and "surrogate" in error["message"], error
    assert not TrainingJob.objects.exists()


@pytest.mark.parametrize("raw, field", [
    (json.dumps({"data": [{"prompt": "q", "completion": "a", "score": float("nan")}],
                 "config": {"output_name": "x"}}).encode("utf-16"), "data.0.score"),
    (json.dumps({"data": [{"prompt": "q\x00", "completion": "a"}], "config": {"output_name": "x"}}).encode("utf-32-le"),
     "data.0.prompt"),
    ('{"data": [{"prompt": "q\ud800", "completion": "a"}], "config": {"output_name": "x"}}'.encode(
        "utf-8", "surrogatepass"), "data.0.prompt"),
], ids=["nan-in-utf-16", "nul-in-utf-32", "raw-surrogate-bytes"])
def test_what_is_refused_is_refused_however_the_body_is_encoded(client, raw, field):
    """Python's json reads a UTF-16 or UTF-32 body, and UTF-8 bytes of a lone surrogate, as it reads the UTF-8 text
    of a body: the refusals hold for them too (the suspect spellings were searched for in the raw UTF-8 bytes only,
    so these went through, and a NUL reached the database)."""
    response = client.generic("POST", "/v1/train/sft", data=raw, content_type="application/json")
    error = coded(response, 400)
    assert error["field"] == field, error
    assert not TrainingJob.objects.exists()


def test_a_wide_body_is_checked_in_memory_bounded_by_its_depth():
    """A big inline upload with one suspect spelling is walked holding only the path to the value at hand: the walk
    queued every sibling with its own location tuple and index string, 2 GB and 20 s for a 19 MB list of zeros."""
    import tracemalloc

    from kiln_web.core.http import ActionRefused, json_body

    raw = b'{"data": [' + b",".join([b"0"] * 200_000) + b', [{"x": NaN}]]}'
    tracemalloc.start()
    try:
        value_bytes = tracemalloc.get_traced_memory()[0]
        with pytest.raises(ActionRefused) as info:
            json_body(raw)
        peak = tracemalloc.get_traced_memory()[1] - value_bytes
    finally:
        tracemalloc.stop()
    assert info.value.extra["field"] == "data.200000.0.x"
    parsed = 200_000 * 8 + len(raw) * 2  # the list's slots and the decoded text; the walk adds next to nothing
    assert peak < parsed + (1 << 20), peak


def test_text_that_only_looks_suspect_is_accepted(client, fake_runner):
    """A paired surrogate escape (an emoji), and NaN, Infinity and an escaped backslash before u0000 as text."""
    text = json.dumps(sft_body("looks-suspect")).replace('"q0"', '"\\ud83d\\ude00 NaN Infinity \\\\u0000"')
    response = send(client, "POST", "/v1/train/sft", text)
    assert response.status_code == 201, response.content[:300]
    assert TrainingJob.objects.get().request["data"][0]["prompt"] == "\U0001F600 NaN Infinity \\u0000"


@pytest.mark.parametrize("path", ["/v1/train/sft", "/v1/teachers", "/v1/completions", "/v1/chat/completions"])
def test_a_body_nested_past_the_parsers_depth_is_not_json(client, path):
    error = coded(send(client, "POST", path, "[" * 100_000 + "]" * 100_000), 400)
    assert error["message"] == "the request body is not JSON"


@pytest.mark.parametrize("path, text, param", [
    ("/v1/completions", '{"prompt": "x\\ud800", "max_tokens": 1}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udc00"}]}', "messages.0.content"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 1, "temperature": NaN}', "temperature"),
])
def test_serving_refuses_what_its_tokenizer_cannot_take_naming_the_param(client, path, text, param):
    error = coded(send(client, "POST", path, text), 400)
    assert error["param"] == param, error


@pytest.mark.parametrize("method, path, field", [
    ("GET", "/v1/teachers/t%00@openai", "name"),
    ("PUT", "/v1/teachers/%00", "name"),
    ("DELETE", "/v1/teachers/t%00", "name"),
    ("GET", "/v1/evals/suites/s%00", "name"),
    ("DELETE", "/v1/adapters/some-bot/shares/user/%00", "target"),
    ("DELETE", "/v1/adapters/some-bot/shares/group/g%00", "target"),
    ("GET", "/v1/train/jobs?adapter=%00", "adapter"),
    ("GET", "/v1/evals/runs?adapter=b%00t", "adapter"),
    ("GET", "/v1/promotions?adapter=%00", "adapter"),
    ("GET", "/v1/train/jobs?%00=1", "\x00"),
    ("GET", "/v1/models?x=%00", "x"),
])
def test_a_nul_in_a_path_or_query_parameter_is_refused_naming_it(client, method, path, field):
    error = coded(client.generic(method, path), 400)
    assert error["field"] == field and "NUL" in error["message"], error


# -- values the schema takes but the run could not: refused at admission, never by the worker --

BEYOND_64_BITS = 2**63  # a checkpoint manifest holds signed 64-bit integers; the job failed bad_field at its first


@pytest.mark.parametrize("path, body, field", [
    ("/v1/train/sft", _sft(batch_size=BEYOND_64_BITS), "config.batch_size"),
    ("/v1/train/sft", _sft(checkpoint_interval=2**64), "config.checkpoint_interval"),
    ("/v1/train/sft", _sft(lr_schedule={"warmup_steps": BEYOND_64_BITS}), "config.lr_schedule.warmup_steps"),
    ("/v1/train/grpo", grpo_inline("malformed", checkpoint_interval=BEYOND_64_BITS), "config.checkpoint_interval"),
    # the quantizer takes bitsandbytes' block sizes only: the worker failed internal_error (ValueError)
    ("/v1/train/sft", _sft(quantization={"type": "nf4", "block_size": 33}), "config.quantization.block_size"),
    ("/v1/train/sft", _sft(quantization={"type": "nf4", "block_size": 2**40}), "config.quantization.block_size"),
    # a rank past what the targeted projections hold: the worker failed internal_error (MemoryError)
    ("/v1/train/sft", _sft(lora={"rank": 2**40}), "config.lora.rank"),
    ("/v1/train/grpo", grpo_inline("malformed", lora={"rank": 2**40}), "config.lora.rank"),
], ids=["sft-batch_size", "sft-checkpoint_interval", "sft-warmup_steps", "grpo-checkpoint_interval",
        "nf4-block-33", "nf4-block-2**40", "sft-rank", "grpo-rank"])
def test_a_value_the_run_cannot_take_is_refused_at_admission(client, path, body, field):
    error = coded(client.post(path, json.dumps(body), content_type="application/json"), 400)
    assert error["field"] == field, error
    assert not TrainingJob.objects.exists()


@pytest.mark.parametrize("relative", [True, False], ids=["basename", "absolute"])
def test_a_resume_checkpoint_name_too_long_for_the_filesystem_is_noncanonical(client, settings, relative):
    """Was an OSError (ENAMETOOLONG) from the registry lookup: 500."""
    name = "x" * 300 + "-checkpoint-step-00000001.kiln-checkpoint"
    reference = name if relative else f"{settings.KILN_ADAPTERS_DIR}/{name}"
    response = client.post("/v1/train/sft", json.dumps(_sft(resume_checkpoint=reference)),
                           content_type="application/json")
    coded(response, 400, "noncanonical_name")


@pytest.mark.parametrize("method, path", [("POST", "/v1/teachers"), ("PUT", "/v1/teachers/{name}")])
def test_a_teacher_value_longer_than_its_column_is_refused_naming_it(client, ada, method, path):
    """Was admitted on SQLite and a DataError (value too long) 500 on PostgreSQL."""
    from kiln_web.teachers.actions import do_create_teacher

    alias = do_create_teacher(ada, "long@openai", {"endpoint": "http://gpu-1:8000", "model": "m"})
    endpoint = "http://gpu-1:8000/" + "v" * 1000
    body = {"endpoint": endpoint, "model": "m"} | ({"name": "longer@openai"} if method == "POST" else {})
    error = coded(send(client, method, path.format(name=alias.name), json.dumps(body)), 400)
    assert error["field"] == "endpoint" and "at most 1000" in error["message"], error
    assert list(TeacherAlias.objects.values_list("name", "endpoint")) == [("long@openai", "http://gpu-1:8000")]


@pytest.mark.parametrize("line, words", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),  # was a RecursionError: 500
    ('{"prompt": "2+2\\ud800", "expected": "4"}', "surrogate"),  # was stored, for the worker's tokenizer to fail on
    ('{"messages": [{"role": "user", "content": "\\udfff"}], "expected": "4"}', "surrogate"),
    ('{"prompt": "2+2", "expected": "4\\ud800"}', "surrogate"),
])
def test_a_suite_line_that_is_not_text_json_is_refused_with_its_line(client, line, words):
    content = '{"prompt": "1+1", "expected": "2"}\n' + line + "\n"
    error = coded(client.post("/v1/evals/suites", json.dumps({"name": "odd", "content": content}),
                              content_type="application/json"), 400, "invalid_suite")
    assert error["field"] == "content" and error["message"].startswith("line 2: ") and words in error["message"]


# -- a dataset file's lines: refused at admission as any line that is not JSON, naming the file --

DEEP_LINE = "[" * 100_000 + "]" * 100_000
GROUP_WITH = '{"prompt": "p%s", "completions": [{"text": "a", "reward": 1}, {"text": "b", "reward": 0}]}'


@pytest.mark.parametrize("kind, line, words", [
    ("sft", '{"prompt": "q\\ud800", "completion": "a"}', "surrogate"),  # was a TypeError in the tokenizer: 500
    ("sft", '{"prompt": "q", "completion": "a", "meta": ' + DEEP_LINE + "}", "nested too deeply"),  # RecursionError
    ("sft", "[" * 70 + "]" * 70, "nested too deeply"),  # past the reader's 64 levels, short of the parser's limit
    ("grpo", GROUP_WITH % "\\udc00", "surrogate"),
    ("grpo", DEEP_LINE, "nested too deeply"),
], ids=["sft-surrogate", "sft-deep", "sft-64-levels", "grpo-surrogate", "grpo-deep"])
def test_a_dataset_line_that_is_not_text_json_is_refused_naming_the_file(client, settings, kind, line, words):
    path = settings.KILN_DATASETS_DIR / f"malformed-{kind}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"prompt": "q", "completion": "a"}\n' * (kind == "sft") + line + "\n")
    body = {"dataset_path": str(path), "config": {"output_name": "malformed"}}
    error = coded(client.post(f"/v1/train/{kind}", json.dumps(body), content_type="application/json"), 400)
    assert error["field"] == "dataset_path" and words in error["message"], error
    assert f"line {2 if kind == 'sft' else 1}" in error["message"], error
    assert not TrainingJob.objects.exists()


@pytest.mark.parametrize("text", ['"p\\ud800"\n', "[" * 70 + "]" * 70 + "\n", '["p", ' + DEEP_LINE + "]"],
                         ids=["jsonl-surrogate", "jsonl-64-levels", "json-list-deep"])
def test_an_opd_prompts_file_that_is_not_text_json_is_refused(settings, text):
    from kiln_web.jobs.runtime import run_settings
    from trainer.runs.admission import RequestError
    from trainer.runs.opd import read_prompts

    path = settings.KILN_DATASETS_DIR / "malformed-prompts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    with pytest.raises(RequestError) as info:
        read_prompts({"dataset_path": str(path)}, run_settings())
    assert info.value.field == "dataset_path"
    assert "surrogate" in str(info.value) or "nested too deeply" in str(info.value)


def test_a_malformed_adapter_name_in_a_body_is_refused_naming_its_field(client):
    body = {"adapter": "not a name!", "suite": "s"}
    error = coded(client.post("/v1/evals/runs", json.dumps(body), content_type="application/json"), 400)
    assert error["field"] == "adapter" and "is not an adapter name" in error["message"], error


def test_a_malformed_adapter_name_in_a_path_is_refused_naming_the_parameter(client):
    error = coded(client.get("/v1/adapters/not%20a%20name!"), 400)
    assert error["field"] == "name" and "is not an adapter name" in error["message"], error
