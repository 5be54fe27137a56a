"""The serving pool: adapters from the registry, activation, canary, concurrency."""

import threading

import pytest

from trainer.generation import SamplingConfig
from trainer.serving import ReadWriteLock, ServingError, ServingPool


@pytest.fixture
def pool(greeter_registry):
    serving = ServingPool(*greeter_registry)
    yield serving
    serving.close()


def prompt_of(pool, text):
    tokenizer = pool.resolve("kiln-tiny").tokenizer
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def test_adapter_changes_outputs_and_activation_sets_the_default(pool):
    prompt = prompt_of(pool, "hi")
    greedy = SamplingConfig(max_new_tokens=12, temperature=0)
    _, base = pool.complete("kiln-tiny", prompt, greedy)
    pool.load_adapter("greeter", "kiln-tiny")
    _, adapted = pool.complete("greeter", prompt, greedy)
    assert adapted.tokens != base.tokens
    with pytest.raises(ServingError) as info:
        pool.complete(None, prompt, greedy)
    assert info.value.code == "model_required"
    pool.activate("greeter")
    _, default = pool.complete(None, prompt, greedy)
    assert default.tokens == adapted.tokens
    assert {m["name"]: m["active"] for m in pool.loaded()} == {"kiln-tiny": False, "greeter": True}
    pool.unload("greeter")
    assert pool.active is None


def test_canary_and_refusals(pool):
    pool.load_adapter("greeter", "kiln-tiny")
    assert pool.canary("greeter") == (True, "loaded, generated and scored")
    assert pool.canary("missing")[0] is False
    with pytest.raises(ServingError) as info:
        pool.load_adapter("missing", "kiln-tiny")
    assert info.value.code == "adapter_not_found"
    with pytest.raises(ServingError) as info:
        pool.activate("kiln-tiny")
    assert info.value.code == "adapter_not_loaded"


def test_concurrent_requests_are_independent(pool):
    pool.load_adapter("greeter", "kiln-tiny")
    prompts = [prompt_of(pool, f"question {i}") for i in range(8)]
    sampling = SamplingConfig(max_new_tokens=10, temperature=0.8, top_p=0.9)
    expected = [pool.complete("greeter", p, sampling, seed=i)[1].tokens for i, p in enumerate(prompts)]
    results = [None] * 8

    def work(i):
        results[i] = pool.complete("greeter", prompts[i], sampling, seed=i)[1].tokens

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected


def test_writer_waits_for_readers():
    lock = ReadWriteLock()
    order = []
    def write():
        with lock.write():
            order.append("write")

    with lock.read():
        writer = threading.Thread(target=write)
        writer.start()
        writer.join(0.1)
        order.append("read done")
    writer.join(120)
    assert not writer.is_alive() and order == ["read done", "write"]


def test_a_request_pinned_to_a_reloaded_adapter_is_served_by_the_new_load(pool):
    """A request resolves its model, then waits for the read lock; a reload that swaps the adapter meanwhile must
    neither refuse it (404 "was unloaded" for an adapter that is loaded) nor let it compute on the replaced model."""
    pool.load_adapter("greeter", "kiln-tiny")
    prompt = prompt_of(pool, "hi")
    greedy = SamplingConfig(max_new_tokens=6, temperature=0)
    pinned = pool.adapter("greeter")
    reloaded = pool.load_adapter("greeter", "kiln-tiny")
    served, generation = pool.complete(None, prompt, greedy, served=pinned)
    assert served is reloaded and not served.model.closed
    assert generation.tokens == pool.complete("greeter", prompt, greedy)[1].tokens


def test_a_replaced_model_is_closed_before_any_request_can_use_it(pool):
    """The model a reload replaces is closed while the pool is locked for writing: a request that takes the read
    lock right after the swap gets the new model, never the old one while it is being closed (on cuda its device
    buffers are freed under the request)."""
    pool.load_adapter("greeter", "kiln-tiny")
    prompt = prompt_of(pool, "hi")
    greedy = SamplingConfig(max_new_tokens=6, temperature=0)
    old = pool.adapter("greeter")
    closing, go_on = threading.Event(), threading.Event()
    real_close = old.model.close

    def slow_close():
        closing.set()
        assert go_on.wait(120)
        real_close()

    old.model.close = slow_close
    reload = threading.Thread(target=pool.load_adapter, args=("greeter", "kiln-tiny"))
    reload.start()
    assert closing.wait(120)  # the reload has swapped its tables and is closing the old model
    outcome = {}

    def request():
        try:
            outcome["served"] = pool.complete(None, prompt, greedy, served=old)[0]
        except Exception as error:  # noqa: BLE001 (recorded for the assertion)
            outcome["error"] = error

    late = threading.Thread(target=request)
    late.start()
    go_on.set()
    for thread in (reload, late):
        thread.join(120)
    assert "error" not in outcome, outcome
    assert outcome["served"] is pool.adapter("greeter") and outcome["served"] is not old
