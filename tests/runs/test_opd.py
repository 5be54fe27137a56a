"""On-policy distillation at the trainer level: exact resume, teacher revisions, guardrails, routes."""

import json
import shutil
import string
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from run_worker import StopAt, run_to_end, run_until_killed
from trainer import LoraConfig, teachers
from trainer.bases import import_base, load_base
from trainer.generation import score_completion
from trainer.peft import export_adapter
from trainer.runs import checkpoint_dir, grpo, opd, sft
from trainer.runs.admission import MANIFEST_FIELDS, AdmissionError, RequestError, RunFailed, RunSettings

PROMPTS = ["Hello", {"prompt": "Tell me a story about"},
           {"messages": [{"role": "user", "content": "What is 2 plus 2?"}]}]
# about a tenth of the byte tokens end a completion; a first one makes it empty (no update)
STOPS = list(string.ascii_lowercase)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """A shared bases root: kiln-tiny, a sharper variant (the teacher base) and a teacher adapter."""
    root = tmp_path_factory.mktemp("bases")
    model, tokenizer = load_base("kiln-tiny", root)
    state = model.state_dict()
    model.close()
    source = root / "hf-sharp"
    source.mkdir()
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * np.float32(25.0)
    save_file(state, str(source / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "bases" / "kiln-tiny" / name, source / name)
    (source / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 260, "max_position_embeddings": 512, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128,
        "head_dim": 16, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}))
    import_base(source, "kiln-sharp", root)
    write_adapter(root, root / "teacher-adapter", seed=5)
    return root


def write_adapter(root, directory, seed, base="kiln-sharp"):
    model, _ = load_base(base, root)
    model.attach_lora(LoraConfig(rank=4, alpha=8, initializer_seed=seed))
    rng = np.random.default_rng(seed)
    model.load_adapter_state_dict({k: rng.standard_normal(v.shape).astype(np.float32)
                                   for k, v in model.adapter_state_dict().items()})
    export_adapter(model, directory)
    model.close()
    return directory


def native_teacher(bases, adapter="teacher-adapter", alias="tutor@native"):
    spec = {"alias": alias, "route": "native", "base": "kiln-sharp",
            "adapter": None if adapter is None else str(bases / adapter)}
    return {**spec, "identity_revision": teachers.identity_revision(spec)}


def make_settings(home: Path, bases: Path) -> RunSettings:
    (home / "datasets").mkdir(parents=True, exist_ok=True)
    (home / "adapters").mkdir(parents=True, exist_ok=True)
    return RunSettings(home=home, registry=home / "adapters", bases_root=bases, data_roots=(home / "datasets",))


def request(teacher, **config):
    base = {"output_name": "distilled-bot", "teacher": teacher, "seed": 9, "steps": 6, "max_new_tokens": 8,
            "learning_rate": 2e-2, "candidates_per_step": 2, "checkpoint_interval": 2,
            "stop_strings": STOPS, "lora": {"rank": 4, "alpha": 8}}
    base.update(config)
    return {"prompts": PROMPTS, "config": base}


def run(settings, req, stop=None):
    hooks = StopAt(stop)
    result = opd.run_opd(opd.admit_opd(req, settings), settings, hooks)
    return result, hooks


def final_files(settings, adapter="distilled-bot"):
    path = checkpoint_dir.latest_checkpoint(settings.registry, adapter)
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def state_of(settings, basename=None, adapter="distilled-bot"):
    path = settings.registry / basename if basename else checkpoint_dir.latest_checkpoint(settings.registry, adapter)
    loaded = checkpoint_dir.load_checkpoint(path, allowed_manifest_fields=MANIFEST_FIELDS)
    return loaded, json.loads(loaded.read(sft.STATE_FILE))


@pytest.fixture(scope="module")
def reference(bases, tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("reference"), bases)
    result, hooks = run(settings, request(native_teacher(bases)))
    assert result.status == "succeeded"
    return settings, result, hooks


def test_fresh_repeat_is_byte_identical(reference, bases, tmp_path):
    settings, result, hooks = reference
    again_settings = make_settings(tmp_path, bases)
    again, again_hooks = run(again_settings, request(native_teacher(bases)))
    assert again.loss_history == result.loss_history
    assert again_hooks.metrics == hooks.metrics
    assert final_files(again_settings) == final_files(settings)


def test_distillation_has_a_real_signal(reference):
    settings, result, hooks = reference
    assert all(m["kl"] > 0.5 for m in hooks.metrics), [m["kl"] for m in hooks.metrics]  # a sharper teacher
    assert all(m["grad_norm"] > 0 for m in hooks.metrics)


def test_empty_candidates_are_consumed_once_without_an_update(reference):
    settings, result, hooks = reference
    _, state = state_of(settings)
    candidates = state["candidates"]
    assert [c["candidate"] for c in candidates] == list(range(len(candidates)))
    empty = [c for c in candidates if c["empty"]]
    assert empty, "the fixed seed must produce at least one empty candidate"
    assert all(c["update_step"] is None for c in empty)
    assert len(candidates) == 6 * 2 + len(empty)  # six steps of two updating candidates
    assert state["loop"]["candidate"] == len(candidates)
    assert sum(m["empty_candidates"] for m in hooks.metrics) == len(empty)


def test_cancel_then_resume_is_byte_identical(reference, bases, tmp_path):
    settings = make_settings(tmp_path, bases)
    first, first_hooks = run(settings, request(native_teacher(bases)), stop=3)
    assert first.status == "cancelled" and first.steps_completed == 3
    summary = first.latest_checkpoint
    assert summary["training_kind"] == "opd"
    assert summary["next_cursor"]["candidate"] >= 6
    assert summary["teacher"]["alias"] == "tutor@native"
    basename = summary["resume_checkpoint"]
    second, second_hooks = run(settings, request(native_teacher(bases), resume_checkpoint=basename))
    assert second.status == "succeeded"
    assert second.loss_history == reference[1].loss_history
    assert first_hooks.metrics + second_hooks.metrics == reference[2].metrics
    assert final_files(settings) == final_files(reference[0])



def test_sigkill_then_resume_in_a_fresh_process_is_byte_identical(reference, bases, tmp_path):
    settings = make_settings(tmp_path, bases)
    req = request(native_teacher(bases))
    run_until_killed(tmp_path, "opd", req, hold_after=4, bases_root=bases)  # held before step 5, then killed
    latest = checkpoint_dir.latest_checkpoint(settings.registry, "distilled-bot")
    assert checkpoint_dir.parse_basename(latest.name)[1] == 4
    assert not (settings.registry / "distilled-bot").exists()  # no final adapter from the killed process
    resumed = run_to_end(tmp_path, "opd", request(native_teacher(bases), resume_checkpoint=latest.name),
                         bases_root=bases)
    assert resumed["status"] == "succeeded" and resumed["steps"] == 6
    assert resumed["loss_history"] == reference[1].loss_history
    # every file of the final checkpoint (adapter, optimizer moments, state with the optimizer's scalars,
    # manifest) and of the final adapter snapshot
    assert final_files(settings) == final_files(reference[0])
    snapshot = {p.name: p.read_bytes() for p in sorted((settings.registry / "distilled-bot").iterdir())}
    assert snapshot == {p.name: p.read_bytes() for p in sorted((reference[0].registry / "distilled-bot").iterdir())}


@pytest.fixture
def cancelled(bases, tmp_path):
    settings = make_settings(tmp_path, bases)
    result, _ = run(settings, request(native_teacher(bases), steps=4), stop=2)
    return settings, result.latest_checkpoint["resume_checkpoint"]


def test_teacher_identity_change_is_refused(cancelled, bases, tmp_path):
    settings, basename = cancelled
    shutil.copytree(bases / "teacher-adapter", tmp_path / "moved-adapter")
    moved = {"alias": "tutor@native", "route": "native", "base": "kiln-sharp",
             "adapter": str(tmp_path / "moved-adapter")}
    moved["identity_revision"] = teachers.identity_revision(moved)
    with pytest.raises(AdmissionError) as info:
        opd.admit_opd(request(moved, steps=4, resume_checkpoint=basename), settings)
    assert info.value.code == "teacher_changed"
    assert [d["field"] for d in info.value.differences] == ["teacher.identity_revision"]


def test_teacher_content_change_is_refused(cancelled, bases, tmp_path):
    settings, basename = cancelled
    changed = tmp_path / "changing-adapter"
    shutil.copytree(bases / "teacher-adapter", changed)
    spec = {"alias": "tutor@native", "route": "native", "base": "kiln-sharp", "adapter": str(changed)}
    spec["identity_revision"] = teachers.identity_revision(spec)
    fresh = make_settings(tmp_path / "run", bases)
    result, _ = run(fresh, request(spec, steps=4), stop=2)
    replacement = write_adapter(bases, tmp_path / "other-weights", seed=6)
    shutil.copy(replacement / "adapter_model.safetensors", changed / "adapter_model.safetensors")
    with pytest.raises(AdmissionError) as info:
        opd.admit_opd(request(spec, steps=4, resume_checkpoint=result.latest_checkpoint["resume_checkpoint"]), fresh)
    assert info.value.code == "teacher_changed"
    fields = [d["field"] for d in info.value.differences]
    assert fields[0] == "teacher.content_revision" and "teacher.content_evidence.adapter_files" in fields


def test_teacher_checked_again_at_dequeue(cancelled, bases, tmp_path):
    settings, basename = cancelled
    admission = opd.admit_opd(request(native_teacher(bases), steps=4, resume_checkpoint=basename), settings)
    opd.revalidate_opd(opd.Admission.from_json(admission.to_json()), settings)
    spec = admission.effective_config["teacher"]
    moved = bases / "teacher-adapter"
    shutil.move(moved, tmp_path / "away")
    try:
        with pytest.raises(AdmissionError) as info:
            opd.revalidate_opd(admission, settings)
        assert info.value.code == "teacher_unavailable" and spec["alias"] in info.value.message
    finally:
        shutil.move(tmp_path / "away", moved)


def test_wrong_training_kind_is_refused(cancelled, bases, tmp_path):
    settings, basename = cancelled
    groups = [{"prompt": "x", "completions": [{"text": "a", "reward": 1}, {"text": "b", "reward": 0}]}]
    with pytest.raises(AdmissionError) as info:
        grpo.admit_grpo({"groups": groups, "config": {"output_name": "distilled-bot",
                                                      "resume_checkpoint": basename}}, settings)
    assert info.value.code == "wrong_kind" and "opd checkpoint" in info.value.message
    with pytest.raises(AdmissionError) as info:
        sft.admit_sft({"data": [{"prompt": "x", "completion": "y"}],
                       "config": {"output_name": "distilled-bot", "resume_checkpoint": basename}}, settings)
    assert info.value.code == "wrong_kind"
    done = grpo.run_grpo(grpo.admit_grpo({"groups": groups, "config": {
        "output_name": "rl-bot", "checkpoint_interval": 1, "lora": {"rank": 4, "alpha": 8}}}, settings), settings)
    with pytest.raises(AdmissionError) as info:
        opd.admit_opd(request(native_teacher(bases), output_name="rl-bot",
                              resume_checkpoint=done.latest_checkpoint["resume_checkpoint"]), settings)
    assert info.value.code == "wrong_kind" and "grpo checkpoint" in info.value.message


def test_config_drift_is_refused(cancelled, bases):
    settings, basename = cancelled
    with pytest.raises(AdmissionError) as info:
        opd.admit_opd(request(native_teacher(bases), steps=4, temperature=0.7, resume_checkpoint=basename), settings)
    assert info.value.code == "resume_drift"
    assert "config.temperature" in {d["field"] for d in info.value.differences}


@pytest.mark.parametrize("guardrails,config,name", [
    ({"entropy_floor": 6.0}, {}, "entropy_floor"),  # above ln(260): the student is always "too flat"
    ({"max_repetition_rate": 0.5}, {"temperature": 0.0, "stop_strings": [], "max_new_tokens": 12},
     "max_repetition_rate"),  # greedy decoding of the random student loops
    ({"max_empty_rate": 0.5}, {"stop_strings": list(string.printable) + ["\ufffd"]}, "max_empty_rate"),
    ({"kl_ceiling": 0.5}, {}, "kl_ceiling"),  # the sharper teacher is far from the student
])
def test_each_guardrail_stops_the_run(bases, tmp_path, guardrails, config, name):
    settings = make_settings(tmp_path, bases)
    req = request(native_teacher(bases), guardrails={**guardrails, "window": 4}, **config)
    with pytest.raises(RunFailed) as info:
        run(settings, req)
    assert info.value.code == f"guardrail_{name}"
    assert name in info.value.message and "last 4 candidates" in info.value.message


def test_guardrail_window_is_checkpointed_and_restored(bases, tmp_path):
    settings = make_settings(tmp_path, bases)
    req = request(native_teacher(bases), guardrails={"max_empty_rate": 0.9, "window": 3})
    result, _ = run(settings, req, stop=2)
    _, state = state_of(settings, result.latest_checkpoint["resume_checkpoint"])
    assert len(state["guardrails"]["window"]) == 3
    assert state["guardrails"]["config"]["max_empty_rate"] == 0.9
    assert state["rng"]["rollout"]["bit_generator"] == "PCG64"


def test_base_adapter_warm_start(bases, tmp_path):
    """A student warm-started from the teacher's own adapter over the teacher's base matches it exactly."""
    settings = make_settings(tmp_path, bases)
    shutil.copytree(bases / "teacher-adapter", settings.registry / "warm")
    req = request(native_teacher(bases), base_model="kiln-sharp", base_adapter=str(settings.registry / "warm"),
                  lora=None, steps=1, checkpoint_interval=None)
    admission = opd.admit_opd(req, settings)
    assert admission.identities["base_adapter"]["files"]["adapter_model.safetensors"]
    result, hooks = run(settings, req)
    assert result.loss_history == [0.0]
    with pytest.raises(RequestError) as info:
        opd.admit_opd(request(native_teacher(bases), base_adapter=str(settings.registry / "warm"),
                              lora={"rank": 2, "alpha": 8}), settings)
    assert info.value.field == "config.lora"


def test_request_validation(bases, tmp_path):
    settings = make_settings(tmp_path, bases)
    teacher = native_teacher(bases)
    assert opd.normalise_config({"output_name": "x", "teacher": teacher}, settings)["checkpoint_interval"] == 25
    cases = [
        ({"prompts": PROMPTS, "config": {"output_name": "x"}}, "config.teacher"),
        ({"prompts": PROMPTS, "config": {"output_name": "x", "teacher": {**teacher, "identity_revision": "0" * 64}}},
         "config.teacher"),
        ({"prompts": PROMPTS, "config": {"output_name": "x", "teacher": {**teacher, "alias": "tutor"}}},
         "config.teacher"),
        ({"prompts": PROMPTS, "config": {"output_name": "x", "teacher": teacher, "checkpoint_interval": 0}},
         "config.checkpoint_interval"),
        ({"prompts": PROMPTS, "config": {"output_name": "x", "teacher": teacher, "guardrails": {"bogus": 1}}},
         "config.guardrails"),
        ({"prompts": [3], "config": {"output_name": "x", "teacher": teacher}}, "prompts[0]"),
        ({"prompts": PROMPTS, "config": {"output_name": "x", "teacher": teacher, "steps": 0}}, "config.steps"),
    ]
    for req, field in cases:
        with pytest.raises(RequestError) as info:
            opd.admit_opd(req, settings)
        assert info.value.field == field, (field, info.value)
    jsonl = tmp_path / "datasets" / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    admission = opd.admit_opd({"dataset_path": str(jsonl), "config": {"output_name": "x", "teacher": teacher}},
                              settings)
    assert admission.identities["dataset"]["prompts"] == 3 and admission.data_source_kind == "file"


# -- the openai route ------------------------------------------------------------------------


class TeacherServer:
    """A tiny OpenAI-compatible server on a free 127.0.0.1 port, scoring with a Kiln model."""

    def __init__(self, model, model_id, digest):
        self.model, self.model_id, self.digest = model, model_id, digest
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, body, headers=()):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in headers:
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path != f"/v1/models/{owner.model_id}":
                    self.send_error(404)
                    return
                self.reply({"id": owner.model_id, "object": "model", "root": "kiln-sharp", "owned_by": "kiln"},
                           [(teachers.DIGEST_HEADER, owner.digest)])

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                ids = np.asarray(body["prompt"], np.int64)
                logits = owner.model.logits(ids[None, :])[0]  # [L,V]
                z = logits.astype(np.float64)
                logp = z - z.max(-1, keepdims=True)
                logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
                echoed = [None] + [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]
                token = int(np.argmax(logp[-1]))
                self.reply({"object": "text_completion", "model": owner.model_id, "choices": [{
                    "index": 0, "text": "", "finish_reason": "length",
                    "logprobs": {"tokens": [str(t) for t in ids.tolist() + [token]],
                                 "token_logprobs": echoed + [float(logp[-1, token])], "top_logprobs": None}}]})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)  # port 0: a free port
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.closed = False

    @property
    def endpoint(self):
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        if not self.closed:
            self.closed = True
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture
def server(bases):
    model, _ = load_base("kiln-sharp", bases)
    from trainer.peft import import_adapter
    import_adapter(model, bases / "teacher-adapter")
    served = TeacherServer(model, "sharp-tutor", "sha256:aaaa")
    yield served
    served.close()
    model.close()


def openai_teacher(served):
    spec = {"alias": "tutor@openai", "route": "openai", "endpoint": served.endpoint, "model": "sharp-tutor"}
    return {**spec, "identity_revision": teachers.identity_revision(spec)}


def test_openai_route_scores_like_the_native_teacher(server, bases):
    client = teachers.open_teacher(teachers.parse_teacher(openai_teacher(server)), bases)
    native = teachers.open_teacher(teachers.parse_teacher(native_teacher(bases)), bases)
    prompt, completion = [72, 105, 33], [10, 65, 66, 67, 258]
    np.testing.assert_allclose(client.score(prompt, completion), native.score(prompt, completion), atol=1e-5)
    np.testing.assert_array_equal(native.score(prompt, completion),
                                  score_completion(native.model, prompt, completion))
    native.close()
    content = teachers.content_revision(teachers.parse_teacher(openai_teacher(server)), bases)
    evidence = content["evidence"]
    assert {k: evidence[k] for k in ("route", "model", "root", "digest")} == {
        "route": "openai", "model": "sharp-tutor", "root": "kiln-sharp", "digest": "sha256:aaaa"}
    assert len(evidence["probe_logprobs"]) == 64  # the served numbers, hashed


def test_openai_teacher_run_and_content_change_refusal(server, bases, tmp_path):
    settings = make_settings(tmp_path, bases)
    teacher = openai_teacher(server)
    result, hooks = run(settings, request(teacher, steps=3), stop=1)
    assert result.status == "cancelled" and hooks.metrics[0]["kl"] > 0.5
    loaded, _ = state_of(settings, result.latest_checkpoint["resume_checkpoint"])
    assert loaded.manifest["training"]["teacher"]["route"] == "openai"
    server.digest = "sha256:bbbb"  # the endpoint now serves other weights under the same id
    with pytest.raises(AdmissionError) as info:
        opd.admit_opd(request(teacher, steps=3, resume_checkpoint=result.latest_checkpoint["resume_checkpoint"]),
                      settings)
    assert info.value.code == "teacher_changed"
    assert {"teacher.content_revision", "teacher.content_evidence.digest"} <= {d["field"] for d in
                                                                               info.value.differences}


def test_unreachable_endpoint_is_refused(bases, tmp_path, server):
    settings = make_settings(tmp_path, bases)
    teacher = openai_teacher(server)
    server.close()
    with pytest.raises(AdmissionError) as info:
        opd.admit_opd(request(teacher), settings)
    assert info.value.code == "teacher_unavailable"


def test_admission_loads_no_weights(bases, tmp_path, monkeypatch):
    from test_sft import refuse_weights
    settings = make_settings(tmp_path, bases)
    before = opd.admit_opd(request(native_teacher(bases)), settings)
    refuse_weights(monkeypatch)
    assert opd.admit_opd(request(native_teacher(bases)), settings).to_json() == before.to_json()


def test_a_native_teacher_over_another_tokenizer_is_refused_naming_both_bases(bases, tmp_path):
    """The teacher scores the student's tokens, so its base must tokenize alike; the refusal names both bases
    and the tokenizer fields that differ (the teacher's as `checkpoint`, the student's as `request`)."""
    source = tmp_path / "hf-other-template"
    shutil.copytree(bases / "hf-sharp", source)
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    (source / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    root = tmp_path / "bases"
    shutil.copytree(bases / "bases", root / "bases")
    import_base(source, "kiln-other-template", root)
    spec = {"alias": "templated@native", "route": "native", "base": "kiln-other-template", "adapter": None}
    teacher = {**spec, "identity_revision": teachers.identity_revision(spec)}
    settings = make_settings(tmp_path / "home", root)
    with pytest.raises(AdmissionError) as info:
        opd.admit_opd(request(teacher), settings)
    error = info.value
    assert error.code == "teacher_tokenizer_mismatch"
    assert "'kiln-other-template'" in error.message and "'kiln-tiny'" in error.message
    assert [d["field"] for d in error.differences] == ["teacher.tokenizer.chat_template_sha256"]


def test_a_prompts_file_s_bad_record_is_named_by_its_line_or_item(tmp_path):
    """As SFT's records: a JSONL file's bad prompt is refused naming dataset_path and its line (blank lines
    counted), a JSON list's by its item, inline prompts by prompts[i]."""
    settings = make_settings(tmp_path, tmp_path)
    bad = {"text": "not a prompt"}
    words = "a prompt is a string, {prompt: string} or {messages: [{role, content}...]}"
    jsonl = tmp_path / "datasets" / "prompts.jsonl"
    jsonl.write_text(f'"first"\n\n{json.dumps(bad)}\n')
    listed = tmp_path / "datasets" / "prompts.json"
    listed.write_text(json.dumps(["first", bad]))
    for source, field, message in (({"dataset_path": str(jsonl)}, "dataset_path", f"line 3: {words}"),
                                   ({"dataset_path": str(listed)}, "dataset_path", f"item 1: {words}"),
                                   ({"prompts": ["first", bad]}, "prompts[1]", words)):
        with pytest.raises(RequestError) as info:
            opd.read_prompts(source, settings)
        assert (info.value.field, info.value.message) == (field, message)
    jsonl.write_text('"first"\n\n"second"\n')
    records, _, kind = opd.read_prompts({"dataset_path": str(jsonl)}, settings)
    assert kind == "file" and [r["prompt"] for r in records] == ["first", "second"] and records.lines == [1, 3]


def test_a_chat_prompt_s_rollout_ends_at_the_end_of_turn(tmp_path):
    """The student's rollouts stop where its answers end, as /v1/chat/completions and evaluations stop them: a chat
    prompt at the template's end-of-turn marker as well as end of text (for a base whose end of text is not that
    marker, as older Llama 3 and Phi-3 conversions, a rollout ran past its turn and the student was trained to write
    the next one), a plain prompt at end of text; TRL samples with the model's generation config, whose eos ids hold
    both for such bases."""
    from trainer.tokenizer import Tokenizer

    _, tiny = load_base("kiln-tiny", tmp_path)
    files = tiny.files()
    config = {**json.loads(files["tokenizer_config.json"]), "eos_token": "<|endoftext|>"}
    tokenizer = Tokenizer(files["tokenizer.json"], config)
    end_of_turn = tokenizer.token_to_id("<|im_end|>")
    assert end_of_turn is not None and tokenizer.eos_token_id != end_of_turn
    run = {**opd.OPD_DEFAULTS, "max_new_tokens": 8, "stop_strings": []}
    samplings = opd.rollout_sampling(run, tokenizer, PROMPTS)
    assert [s.stop_token_ids for s in samplings] == [(tokenizer.eos_token_id,), (tokenizer.eos_token_id,),
                                                      (tokenizer.eos_token_id, end_of_turn)]
    assert {(s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.stop_strings) for s in samplings} == {
        (8, run["temperature"], run["top_p"], run["top_k"], ())}
