"""KV-cached generation: equality with full forward passes and with transformers' greedy."""

import json

import numpy as np
import pytest
import torch
import transformers

from trainer import DecoderOnlyTransformer, TransformerConfig
from trainer.generation import (KVCache, SamplingConfig, SamplingRNG, generate, score_completion)


def make_model(algorithm="dense"):
    config = TransformerConfig(vocabulary_size=64, maximum_context=48, model_width=32, head_count=4,
                               kv_head_count=2, block_count=2, feed_forward_width=48,
                               initializer_range=0.3, attention_algorithm=algorithm,
                               attention_block_size=4)
    return DecoderOnlyTransformer(config)


class ByteishTokenizer:
    """Token t decodes to chr(ord('a') + t % 26): enough to exercise stop strings."""

    def decode(self, ids):
        return "".join(chr(ord("a") + t % 26) for t in ids)


PROMPT = [1, 5, 9, 33, 2]


@pytest.mark.parametrize("algorithm", ["dense", "tiled"])
def test_cached_logits_equal_full_forward(algorithm):
    model = make_model(algorithm)
    tokens = np.random.default_rng(0).integers(0, 64, (1, 20))
    full = model.logits(tokens)[0]
    cache = KVCache(model)
    pieces = [model.forward_cached(tokens[:, :7], cache)[0]]
    for t in range(7, 20):
        pieces.append(model.forward_cached(tokens[:, t:t + 1], cache)[0])
    cached = np.concatenate(pieces)
    assert cache.length == 20
    np.testing.assert_allclose(cached, full, atol=2e-5, rtol=0)


@pytest.mark.parametrize("algorithm", ["dense", "tiled"])
def test_greedy_equals_transformers(algorithm):
    model = make_model(algorithm)
    cfg = model.config
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=cfg.vocabulary_size, hidden_size=cfg.model_width,
        intermediate_size=cfg.feed_forward_width, num_hidden_layers=cfg.block_count,
        num_attention_heads=cfg.head_count, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.maximum_context, rms_norm_eps=cfg.norm_epsilon,
        rope_theta=cfg.rope_theta, tie_word_embeddings=False)).float()
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()})
    ours = generate(model, PROMPT, SamplingConfig(max_new_tokens=25, temperature=0))
    theirs = hf.generate(torch.tensor([PROMPT]), max_new_tokens=25, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert ours.tokens == theirs
    assert ours.finish_reason == "length"


def test_logprobs_are_the_models_own():
    model = make_model()
    result = generate(model, PROMPT, SamplingConfig(max_new_tokens=12, temperature=1.3, top_k=8),
                      SamplingRNG(3), echo=True)
    scored = score_completion(model, PROMPT, result.tokens)
    np.testing.assert_allclose(result.logprobs, scored, atol=1e-5)
    prompt_scored = score_completion(model, PROMPT[:1], PROMPT[1:])
    np.testing.assert_allclose(result.prompt_logprobs, prompt_scored, atol=1e-5)
    assert all(lp <= 0 for lp in result.logprobs)


def test_same_seed_same_tokens_and_state_round_trip():
    model = make_model()
    config = SamplingConfig(max_new_tokens=20, temperature=0.9, top_p=0.9, top_k=20)
    first = generate(model, PROMPT, config, SamplingRNG(11))
    second = generate(model, PROMPT, config, SamplingRNG(11))
    assert first.tokens == second.tokens
    other = generate(model, PROMPT, config, SamplingRNG(12))
    assert other.tokens != first.tokens
    rng = SamplingRNG(5)
    generate(model, PROMPT, SamplingConfig(max_new_tokens=4, temperature=1.0), rng)
    state = json.loads(json.dumps(rng.state()))
    continued = generate(model, PROMPT, config, rng)
    resumed = generate(model, PROMPT, config, SamplingRNG.from_state(state))
    assert continued.tokens == resumed.tokens


def test_top_k_one_is_greedy():
    model = make_model()
    greedy = generate(model, PROMPT, SamplingConfig(max_new_tokens=15, temperature=0))
    top1 = generate(model, PROMPT, SamplingConfig(max_new_tokens=15, temperature=2.0, top_k=1),
                    SamplingRNG(0))
    assert top1.tokens == greedy.tokens


def test_stop_token_and_stop_string():
    model = make_model()
    greedy = generate(model, PROMPT, SamplingConfig(max_new_tokens=15, temperature=0))
    stop = greedy.tokens[4]
    first = greedy.tokens.index(stop)
    stopped = generate(model, PROMPT, SamplingConfig(max_new_tokens=15, temperature=0,
                                                     stop_token_ids=(stop,)))
    assert stopped.tokens == greedy.tokens[:first + 1]
    assert stopped.finish_reason == "stop"
    tokenizer = ByteishTokenizer()
    text = tokenizer.decode(greedy.tokens)
    needle = text[6:8]
    cut = generate(model, PROMPT, SamplingConfig(max_new_tokens=15, temperature=0,
                                                 stop_strings=(needle,)), tokenizer=tokenizer)
    assert cut.finish_reason == "stop"
    assert cut.text == text[:text.find(needle)]
    assert needle not in cut.text


def test_refusals():
    model = make_model()
    with pytest.raises(ValueError, match="explicit SamplingRNG"):
        generate(model, PROMPT, SamplingConfig(temperature=1.0))
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, PROMPT, SamplingConfig(temperature=0, stop_strings=("x",)))
    with pytest.raises(ValueError, match="no room"):
        generate(model, list(range(48)), SamplingConfig(temperature=0))
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError, match="PCG64"):
        SamplingRNG.from_state({"bit_generator": "MT19937"})
    limited = generate(model, list(range(40)), SamplingConfig(max_new_tokens=30, temperature=0))
    assert len(limited.tokens) == 8 and limited.finish_reason == "length"
