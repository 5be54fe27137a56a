"""Greedy generation on the real SmolLM2-135M-Instruct equals transformers' greedy output."""

import pytest

from trainer.generation import SamplingConfig, generate

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}],
]


@pytest.mark.parametrize("messages", PROMPTS, ids=["capital", "colours"])
def test_greedy_equals_transformers(smollm2, hf_gguf_model, messages):
    torch = pytest.importorskip("torch")
    model, tokenizer = smollm2
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    ours = generate(model, prompt, SamplingConfig(max_new_tokens=24, temperature=0,
                                                  stop_token_ids=(tokenizer.eos_token_id,)))
    with torch.no_grad():
        theirs = hf_gguf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                        eos_token_id=tokenizer.eos_token_id,
                                        pad_token_id=tokenizer.eos_token_id)[0, len(prompt):].tolist()
    assert ours.tokens == theirs
    assert len(ours.tokens) >= 3 and all(lp <= 0 for lp in ours.logprobs)
