"""The OpenAI-compatible endpoints in-process: answers equal the trainer's own generation, log-probabilities
and echo, stop strings, seeds, the active adapter as the default model, and refusals."""

import json
import math

import numpy as np
import pytest
from asgiref.sync import async_to_sync
from django.test import Client

from kiln_web.serving import runtime
from trainer.generation import SamplingConfig
from trainer.serving import ServingPool

pytestmark = pytest.mark.django_db


@pytest.fixture
def http(ada):
    return Client(HTTP_AUTHORIZATION=f"Bearer {ada.token}")


def post(http, path, body):
    return http.post(path, body, content_type="application/json")


@pytest.fixture
def loaded(api, publish, adapter_name):
    publish(adapter_name, seed=3)
    assert api.post(f"/v1/adapters/{adapter_name}/load").status_code == 200
    return adapter_name


def reference(settings, model, prompt_ids, sampling, seed=None, echo=False, top=0):
    """The trainer's own answer, from a pool of the test's own."""
    pool = ServingPool(settings.KILN_HOME, settings.KILN_ADAPTERS_DIR)
    try:
        if model != "kiln-tiny":
            pool.load_adapter(model, "kiln-tiny")
        served, generation = pool.complete(model, prompt_ids, sampling, seed=seed, echo=echo, top_logprobs=top)
        return served.tokenizer, generation
    finally:
        pool.close()


def test_a_completion_is_the_trainers_generation(http, settings, loaded):
    response = post(http, "/v1/completions", {"model": loaded, "prompt": "clay", "max_tokens": 12,
                                              "temperature": 0.9, "seed": 41})
    assert response.status_code == 200, response.content
    answer = response.json()
    tokenizer, generation = reference(settings, loaded, [99, 108, 97, 121],
                                      SamplingConfig(max_new_tokens=12, temperature=0.9, stop_token_ids=(258,)),
                                      seed=41)
    tokens = generation.tokens[:-1] if generation.tokens[-1] == 258 else generation.tokens
    assert answer["choices"][0]["text"] == tokenizer.decode(tokens, skip_special_tokens=True)
    assert answer["model"] == loaded and answer["object"] == "text_completion"
    assert answer["usage"] == {"prompt_tokens": 4, "completion_tokens": len(generation.tokens),
                               "total_tokens": 4 + len(generation.tokens)}
    assert answer["choices"][0]["finish_reason"] == generation.finish_reason
    again = post(http, "/v1/completions", {"model": loaded, "prompt": "clay", "max_tokens": 12, "temperature": 0.9,
                                           "seed": 41}).json()
    assert again["choices"][0]["text"] == answer["choices"][0]["text"]  # a seed repeats
    other = post(http, "/v1/completions", {"model": loaded, "prompt": "clay", "max_tokens": 12, "temperature": 0.9,
                                           "seed": 42}).json()
    assert other["choices"][0]["text"] != answer["choices"][0]["text"]


def test_echo_scores_the_prompt(http, settings):
    prompt = [104, 101, 108, 108, 111]  # "hello" in kiln-tiny's byte vocabulary
    response = post(http, "/v1/completions", {"model": "kiln-tiny", "prompt": prompt, "max_tokens": 0,
                                              "echo": True, "logprobs": 2})
    assert response.status_code == 200, response.content
    choice = response.json()["choices"][0]
    assert choice["text"] == "hello" and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == list("hello") and logprobs["text_offset"] == [0, 1, 2, 3, 4]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    _, generation = reference(settings, "kiln-tiny", prompt, SamplingConfig(max_new_tokens=1, temperature=0),
                              echo=True, top=2)
    np.testing.assert_allclose(logprobs["token_logprobs"][1:], generation.prompt_logprobs, atol=1e-5)
    for chosen, top in zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]):
        assert len(top) == 2 and max(top.values()) >= chosen - 1e-5 and all(math.isfinite(v) for v in top.values())
    assert response.json()["usage"]["completion_tokens"] == 0


def test_chat_defaults_to_the_active_adapter(api, http, loaded):
    body = {"messages": [{"role": "user", "content": "Say kiln."}], "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 3}
    unactivated = post(http, "/v1/chat/completions", body)  # nothing active for ada: the default base answers
    assert unactivated.status_code == 200 and unactivated.json()["model"] == "kiln-tiny"
    api.post(f"/v1/adapters/{loaded}/activate")
    answer = post(http, "/v1/chat/completions", body).json()
    assert answer["model"] == loaded and answer["object"] == "chat.completion"
    named = post(http, "/v1/chat/completions", {**body, "model": loaded}).json()
    assert named["choices"][0]["message"] == answer["choices"][0]["message"]
    base = post(http, "/v1/chat/completions", {**body, "model": "kiln-tiny"}).json()
    assert base["model"] == "kiln-tiny" and base["choices"][0]["logprobs"] != answer["choices"][0]["logprobs"]
    content = answer["choices"][0]["logprobs"]["content"]
    assert content and all(len(item["top_logprobs"]) == 3 for item in content)
    assert all(item["top_logprobs"][0]["logprob"] >= item["logprob"] - 1e-5 for item in content)  # greedy


def test_stop_strings_cut_the_answer(http):
    body = {"model": "kiln-tiny", "prompt": "glaze", "max_tokens": 40, "temperature": 0}
    full = post(http, "/v1/completions", body).json()["choices"][0]["text"]
    stop = full[5:7]
    assert len(full) > 8 and stop and "\ufffd" not in stop
    cut = post(http, "/v1/completions", {**body, "stop": [stop]}).json()["choices"][0]
    assert cut["text"] == full[:full.find(stop)] and cut["finish_reason"] == "stop"


def test_models_lists_bases_and_loaded_adapters(api, http, loaded):
    api.post(f"/v1/adapters/{loaded}/activate")
    listing = http.get("/v1/models").json()
    assert listing["object"] == "list"
    models = {item["id"]: item["kiln"] for item in listing["data"]}
    assert models["kiln-tiny"]["kind"] == "base"
    assert models[loaded] == {"kind": "adapter", "active": True, "base": "kiln-tiny"}


def test_refusals(http, loaded):
    assert Client().post("/v1/completions", {}, content_type="application/json").status_code == 401
    assert Client(HTTP_AUTHORIZATION="Bearer kiln_wrong").get("/v1/models").status_code == 401
    assert http.get("/v1/completions").status_code == 405
    cases = [
        ({"model": "kiln-tiny", "prompt": "a", "n": 2}, 400, "invalid_request"),
        ({"model": "kiln-tiny", "prompt": "a", "temperature": 3}, 400, "invalid_request"),
        ({"model": "kiln-tiny", "prompt": "a", "max_tokens": 0}, 400, "invalid_request"),
        ({"model": "kiln-tiny", "prompt": "a", "logit_bias": {"1": 5}}, 400, "invalid_request"),
        ({"model": "kiln-tiny", "prompt": [999]}, 400, "invalid_request"),
        ({"model": "kiln-tiny", "prompt": "a" * 600}, 400, "context_length_exceeded"),
        ({"model": "no-such-model", "prompt": "a"}, 404, "model_not_found"),
        ({"model": "../../etc/passwd", "prompt": "a"}, 404, "model_not_found"),
        ({"model": "kiln-tiny"}, 400, "invalid_request"),
    ]
    for body, status, code in cases:
        response = post(http, "/v1/completions", body)
        assert (response.status_code, response.json()["error"]["code"]) == (status, code), body
        assert response.json()["error"]["message"]
    fields = [  # a model validator's refusals name their field as OpenAI's param
        ({"model": "kiln-tiny", "prompt": "a", "n": 2}, "n", "n: Kiln returns one choice per prompt"),
        ({"model": "kiln-tiny", "prompt": "a", "logit_bias": {"1": 5}}, "logit_bias", "logit_bias: not supported"),
        ({"model": "kiln-tiny", "prompt": "a", "stop": ["", "x"]}, "stop", "stop: at most 4 non-empty strings"),
        ({"model": "kiln-tiny", "prompt": "a", "best_of": 2}, "best_of", "best_of: not supported"),
    ]
    for body, param, words in fields:
        error = post(http, "/v1/completions", body).json()["error"]
        assert error["param"] == param and error["message"].startswith(words) and "Value error" not in error["message"]
    bad = post(http, "/v1/chat/completions", {"model": loaded, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


def test_a_pool_follows_the_served_adapters_of_other_processes(ada, http, publish, adapter_name):
    """Rows written elsewhere (a worker that promoted) are served here on the next request."""
    from kiln_web.adapters.models import Adapter
    from kiln_web.serving import actions

    publish(adapter_name, seed=5)
    adapter = Adapter.objects.create(name=adapter_name, owner=ada)
    actions.do_promote(adapter, "kiln-tiny", runtime.snapshot_sha256(adapter_name), decided_by="gate",
                       reason="test")
    assert runtime.started() is None  # this process had no pool yet
    answer = post(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 3, "temperature": 0})
    assert answer.status_code == 200 and answer.json()["model"] == adapter_name


def test_top_k_and_top_p_at_their_edges(http):
    """top_k (vLLM's extension; the trainer samples with it) is applied, not ignored: top_k 1 is the greedy answer
    at any temperature; OpenAI's top_p 0 keeps only the most probable token, so it is greedy too; top_k 0 or -1
    (no limit) and top_p 1 are plain sampling."""
    body = {"model": "kiln-tiny", "prompt": "glaze", "max_tokens": 12}
    greedy = post(http, "/v1/completions", {**body, "temperature": 0}).json()["choices"][0]["text"]
    sampled = post(http, "/v1/completions", {**body, "temperature": 1, "seed": 1}).json()["choices"][0]["text"]
    assert sampled != greedy
    for edge in ({"top_k": 1}, {"top_p": 0}, {"top_k": 1, "top_p": 0.5}):
        response = post(http, "/v1/completions", {**body, "temperature": 1, "seed": 1, **edge})
        assert response.status_code == 200, (edge, response.content)
        assert response.json()["choices"][0]["text"] == greedy, edge
    for unlimited in ({"top_k": 0}, {"top_k": -1}, {"top_p": 1}):
        response = post(http, "/v1/completions", {**body, "temperature": 1, "seed": 1, **unlimited})
        assert response.json()["choices"][0]["text"] == sampled, unlimited
    chat = {"model": "kiln-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    chat_greedy = post(http, "/v1/chat/completions", {**chat, "temperature": 0}).json()["choices"][0]["message"]
    chat_top1 = post(http, "/v1/chat/completions", {**chat, "seed": 4, "top_k": 1}).json()["choices"][0]["message"]
    assert chat_top1 == chat_greedy
    for bad in ({"top_k": -2}, {"top_k": 1.5}, {"top_p": -0.1}, {"top_p": 1.1}):
        error = post(http, "/v1/completions", {**body, **bad}).json()["error"]
        assert error["param"] == next(iter(bad)), bad


def test_openai_fields_that_would_change_the_answer_are_refused_not_ignored(http):
    """Tools and JSON mode are OpenAI fields that change the answer; Kiln implements neither, so a request with
    them is refused (naming the field) instead of answered as if they were absent. Their neutral values pass."""
    chat = {"model": "kiln-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    for extra, param in [({"tools": [tool]}, "tools"), ({"functions": [tool["function"]]}, "functions"),
                         ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                          "response_format"),
                         ({"tool_choice": "required"}, "tool_choice")]:
        response = post(http, "/v1/chat/completions", {**chat, **extra})
        assert response.status_code == 400, (extra, response.content)
        assert response.json()["error"]["param"] == param, extra
    for neutral in ({"tools": []}, {"tool_choice": "none"}, {"tool_choice": "auto"},
                    {"response_format": {"type": "text"}}, {"response_format": None}):
        response = post(http, "/v1/chat/completions", {**chat, **neutral})
        assert response.status_code == 200, (neutral, response.content)
    refused = post(http, "/v1/completions", {"model": "kiln-tiny", "prompt": "a", "max_tokens": 2,
                                             "response_format": {"type": "json_object"}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"


def _events(response) -> list:
    """The server-sent events of a streamed answer, each decoded (the [DONE] marker as the string)."""
    async def collect():
        return b"".join([chunk async for chunk in response.streaming_content])

    text = async_to_sync(collect)().decode()
    events = [block[len("data: "):] for block in text.split("\n\n") if block.startswith("data: ")]
    return [event if event == "[DONE]" else json.loads(event) for event in events]


def test_a_stream_that_fails_mid_answer_ends_with_an_error_event(http, monkeypatch, caplog):
    """A bug in generation after the first token (anything but a refusal) ends the stream with an error event in the
    API's shape, internal_error, and is logged with its traceback; the stream does not just stop (a client then
    cannot tell a failure from a cut connection), and the next request is served."""
    from kiln_web.serving import views

    real = views._generate

    def fails_after_a_token(serving, served, plan, prompt, on_token=None):
        def first_then_fail(token, logprob, top):
            on_token(token, logprob, top)
            raise RuntimeError("a bug in generation")
        return real(serving, served, plan, prompt, first_then_fail)

    monkeypatch.setattr(views, "_generate", fails_after_a_token)
    body = {"model": "kiln-tiny", "prompt": "glaze", "max_tokens": 8, "temperature": 0, "stream": True}
    with caplog.at_level("ERROR", logger="kiln.serving"):
        events = _events(post(http, "/v1/completions", body))
    assert events[-1] == {"error": {"code": "internal_error", "type": "server_error", "param": None,
                                    "message": "the server failed while generating this answer; its log has the "
                                               "details"}}, events
    assert "[DONE]" not in events and any("choices" in event for event in events[:-1])
    assert any("a bug in generation" in (record.exc_text or "") or record.exc_info for record in caplog.records)
    monkeypatch.setattr(views, "_generate", real)
    assert _events(post(http, "/v1/completions", body))[-1] == "[DONE]"


def test_token_prompts_and_chat_messages_are_parsed_strictly(http):
    """A token list holds integers, not booleans (true is not token 1); a chat message of a system, user or tool role
    carries its content (an assistant's may be null, as OpenAI's); each refusal names its field."""
    for prompt in ([True], [[1, False]]):
        response = post(http, "/v1/completions", {"model": "kiln-tiny", "prompt": prompt, "max_tokens": 1})
        assert response.status_code == 400, (prompt, response.content)
        assert response.json()["error"]["param"] == "prompt", response.content
    for role in ("system", "user"):
        response = post(http, "/v1/chat/completions", {"model": "kiln-tiny", "max_tokens": 1,
                                                       "messages": [{"role": role}]})
        assert response.status_code == 400, (role, response.content)
        assert response.json()["error"]["param"] == "messages", response.content
    answer = post(http, "/v1/chat/completions", {"model": "kiln-tiny", "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None}, {"role": "user", "content": "x"}]})
    assert answer.status_code == 200, answer.content
