"""Base families against transformers: Llama 3 (rotary scaling), Qwen2 (q/k/v biases), Qwen3 (q/k
norms, explicit head_dim), Mistral (sliding window) and Phi-3 (fused qkv_proj and gate_up_proj, a
sliding window). Each is a tiny random model that transformers builds from its config and saves with
save_pretrained (norms and biases randomised, so that loading them is tested too), and a GGUF file
written from the same weights with llama.cpp's tensor names (gguf's TensorNameMap), its Q/K
permutation for llama and its rope_freqs.weight for Llama 3's scaling.
"""

import json

import numpy as np
import pytest

from tests.models.conftest import add_gguf_architecture
from trainer import LoraConfig
from trainer.bases import import_base, load_base
from trainer.blocks import rope_tables
from trainer.generation import SamplingConfig, generate
from trainer.peft import export_adapter, import_adapter
from trainer.tokenizer import bytes_to_unicode

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
gguf = pytest.importorskip("gguf")

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.1)
# two frequencies between the wavelength bounds (167 and 861 of [125, 1000]), so all three regimes occur
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
               "original_max_position_embeddings": 1000}
# family -> (transformers config and model class names, config fields); windows shorter than the tokens
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=7, pad_token_id=0, bos_token_id=1,
                                                   eos_token_id=2)),
}
KILN_FAMILY = {"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "phi3": "phi3"}
TOKENS = np.random.default_rng(7).integers(0, 300, (2, 20))


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    """family -> (HF directory, transformers model in eval mode), built once per family."""
    from tests.models.conftest import _tiny_tokenizer

    built = {}

    def build(family):
        if family not in built:
            config_class, model_class, fields = FAMILIES[family]
            torch.manual_seed(sorted(FAMILIES).index(family))
            config = getattr(transformers, config_class)(**COMMON, **fields)
            model = getattr(transformers, model_class)(config).eval()
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    if name.endswith("norm.weight"):
                        parameter.copy_(1 + 0.1 * torch.randn_like(parameter))
                    elif name.endswith("bias"):
                        parameter.copy_(0.1 * torch.randn_like(parameter))
            directory = tmp_path_factory.mktemp(family)
            model.save_pretrained(directory)
            _tiny_tokenizer().save_pretrained(directory)
            built[family] = (directory, model)
        return built[family]

    return build


def reference_logits(hf_model, tokens):
    with torch.no_grad():
        return hf_model(torch.tensor(tokens)).logits.numpy()


def randomised_adapter(model, lora, seed=0):
    model.attach_lora(lora)
    rng = np.random.default_rng(seed)
    model.load_adapter_state_dict({name: rng.normal(0, 0.2, value.shape).astype(np.float32)
                                   for name, value in model.adapter_state_dict().items()})


def peft_model_of(directory, hf_model, adapter, trainable=False):
    base = type(hf_model).from_pretrained(directory, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, adapter, is_trainable=trainable)


# -- forward ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("attention", ["dense", "tiled"])
def test_logits_match_transformers(family_models, family, attention):
    directory, hf_model = family_models(family)
    options = {"attention_algorithm": attention, "attention_block_size": 4} if attention == "tiled" else {}
    model, _ = load_base(directory, **options)
    with model:
        assert model.config.family == KILN_FAMILY[family]
        assert np.abs(model.logits(TOKENS) - reference_logits(hf_model, TOKENS)).max() <= 1e-4


def test_family_options_are_what_config_json_says(family_models):
    configs = {family: load_base(family_models(family)[0])[0].config for family in FAMILIES}
    assert configs["llama3"].rope_scaling == ("llama3", 8.0, 1.0, 8.0, 1000.0)
    assert configs["qwen2"].attention_bias and configs["qwen2"].tie_embeddings
    assert configs["qwen3"].qk_norm and configs["qwen3"].head_dimension == 24
    assert configs["mistral"].sliding_window == 5 and configs["phi3"].sliding_window == 7
    plain = [c for f, c in configs.items() if f in ("mistral", "phi3")]
    assert not any(c.attention_bias or c.qk_norm or c.rope_scaling for c in plain)


def test_llama3_rotary_scaling_changes_only_long_wavelengths(family_models):
    config = load_base(family_models("llama3")[0])[0].config
    from dataclasses import replace
    _, scaled = rope_tables(config)
    _, plain = rope_tables(replace(config, rope_scaling=None))
    assert np.array_equal(scaled[:, 0], plain[:, 0])  # the highest frequency is kept
    # the lowest is divided by the factor: its small angles (sines) shrink eightfold
    assert np.allclose(scaled[1:, -1] * 8, plain[1:, -1], rtol=1e-3)


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_sliding_window_matters_beyond_its_length(family_models, family):
    """Without the window the logits past it differ: the test above really checks the window."""
    directory, hf_model = family_models(family)
    from dataclasses import replace
    model, _ = load_base(directory)
    with model:
        window = model.config.sliding_window
        expected = reference_logits(hf_model, TOKENS)
        model.config = replace(model.config, sliding_window=None)
        unwindowed = model.logits(TOKENS)
    assert np.abs(unwindowed[:, :window] - expected[:, :window]).max() <= 1e-4
    assert np.abs(unwindowed[:, window:] - expected[:, window:]).max() > 1e-3


# -- LoRA against peft -------------------------------------------------------------------------------


def kiln_lora_gradients(model, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    loss = model.forward_backward(inputs, targets)
    return loss, {p.name: p.grad.copy() for p in model.adapter_parameters()}


def peft_gradients(peft_model, tokens, family):
    """{Kiln adapter name: gradient} of peft's mean cross-entropy; fused Phi-3 modules split per member."""
    inputs, targets = torch.tensor(tokens[:, :-1]), torch.tensor(tokens[:, 1:])
    logits = peft_model(inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    grads = {}
    for name, parameter in peft_model.named_parameters():
        if "lora_" in name:
            grads[name.replace("base_model.model.", "").replace(".default", "")] = parameter.grad.numpy()
    return float(loss.detach()), grads


def split_fused(grads, config, rank):
    """Phi-3: the block-diagonal parts of a fused qkv_proj / gate_up_proj gradient, per member."""
    H, KV, D, F = config.head_count, config.kv_heads, config.head_dimension, config.feed_forward_width
    rows = {"qkv_proj": [("q_proj", slice(0, H * D)), ("k_proj", slice(H * D, (H + KV) * D)),
                         ("v_proj", slice((H + KV) * D, (H + 2 * KV) * D))],
            "gate_up_proj": [("gate_proj", slice(0, F)), ("up_proj", slice(F, 2 * F))]}
    out = {}
    for name, grad in grads.items():
        module = name.split(".")[-3]
        if module not in rows:
            out[name] = grad
            continue
        for j, (member, row) in enumerate(rows[module]):
            member_name = name.replace(module, member)
            columns = slice(j * rank, (j + 1) * rank)
            out[member_name] = grad[columns] if ".lora_A." in name else grad[row, columns]
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_logits_gradients_and_export_match_peft(family_models, family, tmp_path):
    directory, hf_model = family_models(family)
    lora = LoraConfig(rank=2, alpha=5.0)
    model, _ = load_base(directory)
    with model:
        randomised_adapter(model, lora)
        logits = model.logits(TOKENS)
        loss, grads = kiln_lora_gradients(model, TOKENS)
        export_adapter(model, tmp_path / "adapter", base_model_name_or_path=family)
        config = model.config
    exported = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    if family == "phi3":  # peft sees Phi-3's own fused modules
        assert sorted(exported["target_modules"]) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
        assert exported["rank_pattern"] == {"qkv_proj": 6, "gate_up_proj": 4}
    peft_model = peft_model_of(directory, hf_model, tmp_path / "adapter", trainable=True)
    with torch.no_grad():
        assert np.abs(peft_model(torch.tensor(TOKENS)).logits.numpy() - logits).max() <= 1e-4
    peft_loss, reference = peft_gradients(peft_model, TOKENS, family)
    reference = split_fused(reference, config, lora.rank)
    assert abs(loss - peft_loss) <= 1e-5
    assert sorted(reference) == sorted(grads)
    for name, grad in grads.items():
        scale = max(1.0, float(np.abs(reference[name]).max()))
        assert np.abs(grad - reference[name]).max() <= 1e-4 * scale, name
    assert any(np.abs(g).max() > 1e-3 for g in grads.values())


def test_phi3_export_round_trips_and_refuses_a_fused_trained_adapter(family_models, tmp_path):
    directory, hf_model = family_models("phi3")
    lora = LoraConfig(rank=2, alpha=4.0, targets=("q_proj", "v_proj", "up_proj"), use_rslora=True)
    model, _ = load_base(directory)
    with model:
        randomised_adapter(model, lora, seed=3)
        original, logits = model.adapter_state_dict(), model.logits(TOKENS)
        export_adapter(model, tmp_path / "partial")
    peft_model = peft_model_of(directory, hf_model, tmp_path / "partial")
    with torch.no_grad():  # the re-fused partial groups (q and v of qkv, up of gate_up) are exact in peft
        assert np.abs(peft_model(torch.tensor(TOKENS)).logits.numpy() - logits).max() <= 1e-4
    fresh, _ = load_base(directory)
    with fresh:
        assert import_adapter(fresh, tmp_path / "partial") == lora
        restored = fresh.adapter_state_dict()
        assert list(restored) == list(original) and all(np.array_equal(restored[k], original[k]) for k in original)

    trained = peft.get_peft_model(type(hf_model).from_pretrained(directory, dtype=torch.float32),
                                  peft.LoraConfig(r=2, lora_alpha=4, target_modules=["qkv_proj"]))
    trained.save_pretrained(tmp_path / "fused")
    fresh, _ = load_base(directory)
    with fresh, pytest.raises(ValueError, match="was trained fused"):
        import_adapter(fresh, tmp_path / "fused")


# -- generation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_equals_transformers(family_models, family):
    directory, hf_model = family_models(family)
    prompt = [5, 17, 99, 250, 3, 42]
    model, _ = load_base(directory)
    with model:
        ours = generate(model, prompt, SamplingConfig(max_new_tokens=14, temperature=0.0)).tokens
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs


# -- GGUF ------------------------------------------------------------------------------------------------


def llama_cpp_permute(weight, heads):  # convert_hf_to_gguf.py LlamaModel.permute
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


def llama3_rope_freqs(config):
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: one divisor per rotary frequency."""
    import math

    rope = config.rope_parameters
    dim = config.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelength = 2 * math.pi / freq
        if wavelength < old / high:
            factors.append(1)
        elif wavelength > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def family_of(hf_model):
    return hf_model.config.model_type


def write_family_gguf(path, hf_model, arch):
    config = hf_model.config
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    add_gguf_architecture(writer, config)
    if arch == "phi3" and config.sliding_window:
        writer.add_sliding_window(config.sliding_window)
    if arch == "phi3" or family_of(hf_model) == "mistral":  # as real Mistral and Phi-3 files: SentencePiece
        pieces = list("▁abcdefghijklmnopqrstuvwxyz") + ["▁t", "he", "▁the"]
        writer.add_tokenizer_model("llama")
        writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces)
        writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
        writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    else:
        spelling = bytes_to_unicode()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt2")
        writer.add_token_list([spelling[b] for b in range(256)] + ["Ġt", "<|endoftext|>", "<|im_start|>",
                                                                   "<|im_end|>"])
        writer.add_token_types([1] * 257 + [3] * 3)
        writer.add_token_merges(["Ġ t"])
        writer.add_bos_token_id(257)
        writer.add_eos_token_id(259)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    if config.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(config))
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        weight = tensor.numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            weight = llama_cpp_permute(weight, config.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            weight = llama_cpp_permute(weight, config.num_key_value_heads)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


GGUF_ARCH = {"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama", "phi3": "phi3"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_imports_to_the_weights_of_the_hf_directory(family_models, family, tmp_path):
    directory, hf_model = family_models(family)
    path = tmp_path / f"{family}.gguf"
    write_family_gguf(path, hf_model, GGUF_ARCH[family])
    from_gguf = import_base(path, "g", root=tmp_path)
    from_hf = import_base(directory, "h", root=tmp_path)
    ours, theirs = dict(from_gguf.config), dict(from_hf.config)
    if family == "mistral":  # llama.cpp converts Mistral as llama and keeps no sliding window
        assert ours.pop("family", "llama") == "llama" and theirs.pop("family") == "mistral"
        assert theirs.pop("sliding_window") == 5 and "sliding_window" not in ours
    assert ours == theirs
    gguf_model, gguf_tokenizer = load_base("g", root=tmp_path)
    hf_loaded, hf_tokenizer = load_base("h", root=tmp_path)
    from tests.models.conftest import TINY_CHAT_TEMPLATE  # each source's own chat template comes along
    assert hf_tokenizer.config["chat_template"] == TINY_CHAT_TEMPLATE
    assert gguf_tokenizer.config["chat_template"] == "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    if family in ("mistral", "phi3"):  # their SentencePiece vocabulary: BOS first, then "▁the"
        assert gguf_tokenizer.encode("the", add_special_tokens=True) == [1, 259 + 29]
    with gguf_model, hf_loaded:
        a, b = gguf_model.state_dict(), hf_loaded.state_dict()
        assert list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a)
        if family != "mistral":
            assert np.abs(gguf_model.logits(TOKENS) - reference_logits(hf_model, TOKENS)).max() <= 1e-4


@pytest.mark.parametrize("scaling", [("llama3", 8.0, 1.0, 4.0, 8192.0), ("llama3", 32.0, 1.0, 4.0, 8192.0),
                                     ("llama3", 8.0, 1.0, 4.0, 32.0)], ids=["llama-3.1", "llama-3.2", "step"])
@pytest.mark.parametrize("head_size", [16, 64, 128])
def test_llama3_scaling_is_recovered_from_rope_freqs(scaling, head_size):
    """llama.cpp stores only the divisors; the scaling read back gives the same ones (the same
    parameters where the divisors determine them: Llama 3.1 and 3.2 at head size 128)."""
    from trainer.bases_sources import llama3_scaling_from_factors
    from trainer.blocks import llama3_frequencies

    inv_freq = 1.0 / (500000.0 ** (np.arange(0, head_size, 2, dtype=np.float64) / head_size))
    divisors = (inv_freq / llama3_frequencies(inv_freq, *scaling[1:])).astype(np.float32)
    recovered = llama3_scaling_from_factors(divisors.astype(np.float64), 500000.0, head_size)
    assert recovered is not None
    again = inv_freq / llama3_frequencies(inv_freq, *recovered[1:])
    assert np.allclose(again, divisors, rtol=1e-5, atol=0)
    if head_size == 128 and scaling[4] == 8192.0:
        assert recovered == scaling


def test_gguf_with_other_rope_frequencies_is_refused(family_models, tmp_path):
    _, hf_model = family_models("llama3")
    path = tmp_path / "odd.gguf"
    write_family_gguf(path, hf_model, "llama")
    reader = gguf.GGUFReader(path, "r+")
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            tensor.data[:] = np.linspace(1.0, 3.0, tensor.data.size, dtype=np.float32)
    del reader
    with pytest.raises(ValueError, match="rope_freqs.weight does not follow Llama 3"):
        import_base(path, "odd", root=tmp_path)


# -- full-parameter gradients, serving ---------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_parameter_gradients_match_transformers(family_models, family):
    """Every base gradient, the family parameters' (biases, q/k norms) included; Phi-3's fused ones split."""
    directory, hf_model = family_models(family)
    model, _ = load_base(directory)
    with model:
        loss = model.forward_backward(TOKENS[:, :-1], TOKENS[:, 1:])
        grads = {p.name: p.grad.copy() for p in model.parameters()}
        config = model.config
    reference = type(hf_model).from_pretrained(directory, dtype=torch.float32)
    logits = reference(torch.tensor(TOKENS[:, :-1])).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.tensor(TOKENS[:, 1:]).reshape(-1))
    expected.backward()
    theirs = {name: p.grad.numpy() for name, p in reference.named_parameters()}
    if family == "phi3":
        from trainer.bases_sources import phi3_fused_names
        for name, (fused, rows) in phi3_fused_names(config).items():
            theirs[name] = theirs[fused][rows]
        theirs = {n: g for n, g in theirs.items() if "qkv_proj" not in n and "gate_up_proj" not in n}
    if config.tie_embeddings:
        theirs.pop("lm_head.weight", None)
    assert abs(loss - float(expected.detach())) <= 1e-5
    assert sorted(grads) == sorted(theirs)
    for name, grad in grads.items():
        scale = max(1.0, float(np.abs(theirs[name]).max()))
        assert np.abs(grad - theirs[name]).max() <= 1e-4 * scale, name
    family_parameters = [n for n in grads if n.endswith(("_proj.bias", "q_norm.weight", "k_norm.weight"))]
    assert bool(family_parameters) == (family in ("qwen2", "qwen3"))
    assert all(np.abs(grads[n]).max() > 0 for n in family_parameters)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_served_adapter_generates_what_peft_generates(family_models, family, tmp_path):
    """The serving pool over an imported base of each family, with an exported adapter, greedy."""
    from trainer.serving import ServingPool

    directory, hf_model = family_models(family)
    import_base(directory, "base", root=tmp_path)
    registry = tmp_path / "adapters"
    registry.mkdir()
    model, _ = load_base("base", root=tmp_path)
    with model:
        randomised_adapter(model, LoraConfig(rank=2, alpha=4.0), seed=5)
        export_adapter(model, registry / "tuned")
    pool = ServingPool(tmp_path, registry)
    try:
        served = pool.load_adapter("tuned", "base")
        prompt = [9, 8, 7, 6, 5, 4, 3]
        _, generation = pool.complete(served.name, prompt, SamplingConfig(max_new_tokens=12, temperature=0.0))
    finally:
        pool.close()
    peft_model = peft_model_of(directory, hf_model, registry / "tuned").eval()
    with torch.no_grad():
        theirs = peft_model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert generation.tokens == theirs


def test_kiln_base_import_names_the_family(family_models, tmp_path, monkeypatch, capsys):
    from kiln_web.cli import main

    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    directory, _ = family_models("qwen3")
    assert main(["base", "import", str(directory), "--name", "q3"]) == 0
    assert "imported q3: qwen3, " in capsys.readouterr().out
    assert main(["base", "show", "q3", "--json"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert (config["family"], config["qk_norm"], config["head_size"]) == ("qwen3", True, 24)
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in directory.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    hf = json.loads((directory / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**hf, "model_type": "gemma2"}))
    assert main(["base", "import", str(broken), "--name", "g"]) == 1
    assert "model_type 'gemma2' is not supported" in capsys.readouterr().err
