"""SFT's objective against transformers + peft: one optimizer step's loss and LoRA gradient over several
accumulated micro-batches, as transformers' Trainer (and TRL's SFTTrainer, which is one) computes them."""

import numpy as np
import pytest

from trainer import LoraConfig
from trainer.bases import load_base
from trainer.model import IGNORE_INDEX
from trainer.peft import export_adapter
from trainer.runs import sft

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.1)


def examples(seed):
    """(tokens, loss mask) pairs of different lengths and prompt lengths, as sft.tokenize_examples makes them."""
    rng = np.random.default_rng(seed)
    out = []
    for length, prompt in [(9, 6), (17, 3), (5, 2), (20, 15), (12, 1), (7, 6)]:
        tokens = rng.integers(3, 300, length).tolist()
        out.append((tokens, [0] * prompt + [1] * (length - prompt)))
    return out


def hf_micro_batch(rows):
    """input_ids and labels (-100 outside the loss, right padding) of EXAMPLES' rows, as a collator makes them."""
    T = max(len(tokens) for tokens, _ in rows)
    input_ids = torch.zeros((len(rows), T), dtype=torch.long)
    labels = torch.full((len(rows), T), -100, dtype=torch.long)
    for row, (tokens, mask) in enumerate(rows):
        input_ids[row, :len(tokens)] = torch.tensor(tokens)
        labels[row, :len(tokens)] = torch.tensor([t if m else -100 for t, m in zip(tokens, mask)])
    return input_ids, labels


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.models.conftest import _tiny_tokenizer
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).eval()
    directory = tmp_path_factory.mktemp("llama")
    model.save_pretrained(directory)
    _tiny_tokenizer().save_pretrained(directory)
    return directory


@pytest.mark.parametrize("batch_size,accumulation", [(1, 3), (2, 3), (3, 2), (6, 1)])
def test_accumulated_step_is_transformers_token_mean(llama, tmp_path, batch_size, accumulation):
    """Trainer divides each micro-batch's summed token losses by the loss tokens of the whole accumulated step
    (num_items_in_batch), so every completion token weighs the same however the tokens fall into micro-batches."""
    data = examples(1)
    groups = [list(range(i, i + batch_size)) for i in range(0, batch_size * accumulation, batch_size)]
    model, _ = load_base(str(llama))
    with model:
        model.attach_lora(LoraConfig(rank=2, alpha=5.0))
        rng = np.random.default_rng(3)
        model.load_adapter_state_dict({name: rng.normal(0, 0.2, value.shape).astype(np.float32)
                                       for name, value in model.adapter_state_dict().items()})
        export_adapter(model, tmp_path / "adapter")
        with model.adapter_parameters() as adapters:
            loss, tokens = sft.accumulate(model, [sft._batch(data, g, 0) for g in groups])
            grads = {p.name: p.grad.copy() for p in adapters}

    base = transformers.LlamaForCausalLM.from_pretrained(llama, dtype=torch.float32)
    reference = peft.PeftModel.from_pretrained(base, tmp_path / "adapter", is_trainable=True)
    batches = [hf_micro_batch([data[i] for i in g]) for g in groups]
    num_items_in_batch = sum(labels[:, 1:].ne(-100).sum() for _, labels in batches)  # Trainer's count
    reference_loss = 0.0
    for input_ids, labels in batches:
        step_loss = reference(input_ids=input_ids, labels=labels, num_items_in_batch=num_items_in_batch).loss
        step_loss.backward()
        reference_loss += float(step_loss.detach())
    assert tokens == int(num_items_in_batch)
    assert abs(loss - reference_loss) <= 1e-5
    for name, parameter in reference.named_parameters():
        if "lora_" in name:
            expected = parameter.grad.numpy()
            got = grads[name.replace("base_model.model.", "").replace(".default", "")]
            assert np.abs(got - expected).max() <= 1e-4 * max(1.0, float(np.abs(expected).max())), name
