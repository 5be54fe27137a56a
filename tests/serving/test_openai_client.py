"""The official `openai` client against a live Kiln (`kiln up` under uvicorn, a temporary KILN_HOME, the
kiln-tiny base and a published adapter, loaded and activated with the `kiln adapter` CLI): completions
and chat, streamed and not, with the streamed text equal to the whole answer; and 8 concurrent clients
whose answers equal the same requests made one at a time."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from controlplane.services import Stack
from trainer.generation import SamplingConfig
from trainer.serving import ServingPool

from .helpers import publish_adapter

openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install -e '.[test]'")

pytestmark = pytest.mark.slow
ADAPTER = "support-bot"
MESSAGES = [{"role": "user", "content": "Say kiln."}]


@pytest.fixture(scope="module")
def kiln(tmp_path_factory):
    home = tmp_path_factory.mktemp("kiln-serving-home")
    (home / "adapters").mkdir(mode=0o700)
    publish_adapter(home, home / "adapters", ADAPTER, seed=21)
    stack = Stack(home, redis_url=None)
    try:
        yield stack
    finally:
        stack.stop()


def kiln_cli(kiln, *args) -> str:
    # the stack's own environment: its KILN_HOME and SQLite database (local commands such as `kiln token create`
    # write there), never the DATABASE_URL the test run itself was given
    env = {**kiln.env, "KILN_URL": kiln.url, "KILN_TOKEN": kiln.token}
    done = subprocess.run([sys.executable, "-m", "kiln_web.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def client(kiln):
    assert f"loaded {ADAPTER} over kiln-tiny" in kiln_cli(kiln, "adapter", "load", ADAPTER)
    assert f"activated {ADAPTER}" in kiln_cli(kiln, "adapter", "activate", ADAPTER)
    assert ADAPTER in kiln_cli(kiln, "adapter", "list") and "active" in kiln_cli(kiln, "adapter", "list")
    return openai.OpenAI(base_url=f"{kiln.url}/v1", api_key=kiln.token, max_retries=0, timeout=60)


def test_completion_with_an_adapter_streamed_and_whole(kiln, client):
    whole = client.completions.create(model=ADAPTER, prompt="Say kiln.", max_tokens=16, temperature=0.8, seed=3)
    text = whole.choices[0].text
    pool = ServingPool(kiln.home, kiln.home / "adapters")  # the trainer's own answer to the same request
    try:
        served = pool.load_adapter(ADAPTER, "kiln-tiny")
        prompt = served.tokenizer.encode("Say kiln.", add_special_tokens=True)
        _, generation = pool.complete(ADAPTER, prompt, SamplingConfig(
            max_new_tokens=16, temperature=0.8, stop_token_ids=(served.tokenizer.eos_token_id,)), seed=3)
        tokens = [t for t in generation.tokens if t != served.tokenizer.eos_token_id]
        assert text == served.tokenizer.decode(tokens, skip_special_tokens=True)
    finally:
        pool.close()
    assert whole.model == ADAPTER and whole.usage.prompt_tokens == len(prompt)
    chunks = list(client.completions.create(model=ADAPTER, prompt="Say kiln.", max_tokens=16, temperature=0.8,
                                            seed=3, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert len(chunks) > 2  # token by token, not one block


def test_chat_with_an_adapter_streamed_and_whole(client):
    whole = client.chat.completions.create(model=ADAPTER, messages=MESSAGES, max_tokens=20, temperature=0.7, seed=9,
                                           logprobs=True, top_logprobs=2)
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    assert whole.usage.completion_tokens >= 1
    assert all(len(item.top_logprobs) == 2 for item in whole.choices[0].logprobs.content)
    stream = client.chat.completions.create(model=ADAPTER, messages=MESSAGES, max_tokens=20, temperature=0.7, seed=9,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == message.content
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    default = client.chat.completions.create(model="", messages=MESSAGES, max_tokens=20, temperature=0.7, seed=9)
    assert default.model == ADAPTER and default.choices[0].message.content == message.content  # the active one
    models = {model.id for model in client.models.list()}
    assert {ADAPTER, "kiln-tiny"} <= models


def test_refusals_reach_the_client_as_errors(kiln, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nobody", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=ADAPTER, prompt="x", max_tokens=2, n=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{kiln.url}/v1", api_key="kiln_wrong", max_retries=0).models.list()


def test_a_client_that_leaves_mid_stream_leaves_the_server_serving(kiln, client):
    stream = client.chat.completions.create(model=ADAPTER, messages=MESSAGES, max_tokens=400, temperature=1.0, seed=1,
                                            stream=True)
    next(iter(stream))
    stream.close()
    answer = client.chat.completions.create(model=ADAPTER, messages=MESSAGES, max_tokens=4, temperature=0)
    assert answer.choices[0].message.content is not None


def test_eight_concurrent_clients_get_their_own_answers(kiln):
    def ask(seed: int, stream: bool) -> str:
        own = openai.OpenAI(base_url=f"{kiln.url}/v1", api_key=kiln.token, max_retries=0, timeout=120)
        request = dict(model=ADAPTER, messages=[{"role": "user", "content": f"Tell me about clay {seed % 3}."}],
                       max_tokens=32, temperature=1.0, seed=seed)
        if stream:
            return "".join(chunk.choices[0].delta.content or "" for chunk in
                           own.chat.completions.create(stream=True, **request))
        return own.chat.completions.create(**request).choices[0].message.content

    seeds = list(range(8))
    sequential = [ask(seed, stream=False) for seed in seeds]
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(ask, seeds, [seed % 2 == 1 for seed in seeds]))
    assert concurrent == sequential  # each answer is the one its seed gives alone
    assert len(set(sequential)) == len(seeds)  # and the answers are independent of each other


def test_the_cli_shares_and_unshares_the_adapter(kiln, client):
    """carol (a token made by `kiln token create`, another process) is answered as for an unknown name until the
    owner shares the adapter with her, and again once it is unshared; the owner's default never becomes hers."""
    carol_token = kiln_cli(kiln, "token", "create", "--user", "carol").strip().splitlines()[-1]
    carol = openai.OpenAI(base_url=f"{kiln.url}/v1", api_key=carol_token, max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError):
        carol.chat.completions.create(model=ADAPTER, messages=MESSAGES, max_tokens=2)
    assert ADAPTER not in [model.id for model in carol.models.list()]
    assert "shared support-bot with the user carol" in kiln_cli(kiln, "adapter", "share", ADAPTER, "--user", "carol")
    assert carol.chat.completions.create(model=ADAPTER, messages=MESSAGES, max_tokens=2).model == ADAPTER
    assert carol.chat.completions.create(messages=MESSAGES, max_tokens=2, model="").model == "kiln-tiny"
    assert "stopped sharing" in kiln_cli(kiln, "adapter", "unshare", ADAPTER, "--user", "carol")
    with pytest.raises(openai.NotFoundError):
        carol.chat.completions.create(model=ADAPTER, messages=MESSAGES, max_tokens=2)


def test_the_cli_unloads_and_deletes_the_adapter(kiln, client):
    assert "it was active" in kiln_cli(kiln, "adapter", "unload", ADAPTER)
    assert f"deleted {ADAPTER}" in kiln_cli(kiln, "adapter", "delete", ADAPTER, "--yes")
    assert not (kiln.home / "adapters" / ADAPTER).exists()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=ADAPTER, messages=MESSAGES, max_tokens=2)
