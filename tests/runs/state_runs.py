"""Real small checkpoints of every kind (SFT, inline and streamed GRPO, OPD), made with kiln-tiny runs, for the
semantic state tests (tests/runs/test_state_check.py, tests/fuzz/test_fuzz_state_semantics.py).

`make_runs(root)` trains each run once with a checkpoint at every step and returns {name: (settings, request,
[checkpoint paths])}; `rewrite(path, change)` edits state.json (or the manifest) of a checkpoint copy and
recomputes every size, SHA-256 and the checkpoint_id exactly as the publisher does.
"""

import hashlib
import json
import string
from pathlib import Path

from controlplane.rl_data import make_group
from trainer.runs import checkpoint_dir, grpo, opd, sft
from trainer.runs.admission import RunSettings

SFT_RECORDS = [
    {"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                  {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4), (6, 1)]
] + [{"prompt": "Say hello.", "completion": "Hello!"}]


GROUPS = [make_group(i) for i in range(5)]  # scored groups with text and chat prompts
OPD_PROMPTS = ["Hello", {"prompt": "Tell me a story about"},
               {"messages": [{"role": "user", "content": "What is 2 plus 2?"}]}]


def settings_in(home: Path) -> RunSettings:
    (home / "datasets").mkdir(parents=True, exist_ok=True)
    (home / "adapters").mkdir(parents=True, exist_ok=True)
    return RunSettings(home=home, registry=home / "adapters", bases_root=home.parent / "bases",
                       data_roots=(home / "datasets",))


def requests(home: Path) -> dict:
    """{run name: (kind module, request)} of the four runs, their data written beneath HOME/<name>."""
    sft_path = home / "sft" / "datasets" / "train.jsonl"
    sft_path.parent.mkdir(parents=True, exist_ok=True)
    sft_path.write_text("".join(json.dumps(r) + "\n" for r in SFT_RECORDS))
    stream_path = home / "grpo_streamed" / "datasets" / "groups.jsonl"
    stream_path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(g) for g in GROUPS]
    lines.insert(2, "")  # a blank line is consumed (and hashed) but is no group
    stream_path.write_text("\n".join(lines) + "\n\n")
    teacher = {"alias": "tutor@native", "route": "native", "base": "kiln-tiny", "adapter": None}
    from trainer import teachers
    teacher["identity_revision"] = teachers.identity_revision(teacher)
    return {
        "sft": (sft, {"dataset_path": str(sft_path), "config": {
            "output_name": "support-bot", "epochs": 2, "learning_rate": 5e-3, "batch_size": 3,
            "gradient_accumulation_steps": 2, "checkpoint_interval": 1, "seed": 7, "max_grad_norm": 0.05,
            "lora": {"rank": 4, "alpha": 8}, "max_sequence_length": 64,
            "lr_schedule": {"type": "cosine", "warmup_steps": 1}}}),
        "grpo_inline": (grpo, {"groups": GROUPS, "config": {
            "output_name": "reward-bot", "seed": 11, "learning_rate": 2e-2, "groups_per_step": 2, "epochs": 1,
            "num_iterations": 2, "beta": 0.05, "loss_type": "dapo", "checkpoint_interval": 1,
            "reference": {"type": "ema", "refresh_steps": 2, "mixup_alpha": 0.5},
            "lora": {"rank": 4, "alpha": 8}, "max_completion_length": 12}}),
        "grpo_streamed": (grpo, {"dataset_path": str(stream_path), "config": {
            "output_name": "stream-bot", "seed": 5, "learning_rate": 2e-2, "groups_per_step": 2, "epochs": 2,
            "beta": 0.0, "loss_type": "grpo", "scale_rewards": "batch", "checkpoint_interval": 1,
            "streaming": True, "lora": {"rank": 4, "alpha": 8}, "epsilon_high": 0.28,
            "max_completion_length": 12}}),
        "opd": (opd, {"prompts": OPD_PROMPTS, "config": {
            "output_name": "distilled-bot", "teacher": teacher, "seed": 9, "steps": 4, "max_new_tokens": 6,
            "learning_rate": 2e-2, "candidates_per_step": 2, "checkpoint_interval": 1,
            "stop_strings": list(string.ascii_lowercase), "lora": {"rank": 4, "alpha": 8},
            "guardrails": {"window": 3, "max_empty_rate": 0.99}}}),
    }


def make_runs(root: Path) -> dict:
    """{name: (settings, request, [checkpoint paths, oldest first])}: each run trained once to completion."""
    runs = {}
    for name, (module, request) in requests(root).items():
        settings = settings_in(root / name)
        kind = module.RUN_KIND
        result = kind.run(kind.admit(request, settings), settings)
        assert result.status == "succeeded", (name, result.status)
        paths = checkpoint_dir.list_checkpoints(settings.registry, request["config"]["output_name"])
        runs[name] = (settings, request, [Path(p) for p in paths])
    return runs


def _canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def publisher_manifest(manifest: dict, directory: Path) -> bytes:
    """The manifest bytes the publisher writes for the files it declares, as they are in DIRECTORY now: each
    file's size and SHA-256, then the checkpoint_id over the rest."""
    manifest = dict(manifest)
    manifest["files"] = {rel: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                         for rel in sorted(manifest["files"]) for data in [(directory / rel).read_bytes()]}
    manifest.pop("checkpoint_id", None)
    manifest["checkpoint_id"] = hashlib.sha256(_canonical(manifest)).hexdigest()
    return _canonical(manifest) + b"\n"


def rewrite(path: Path, state=None, manifest=None, state_raw=None) -> None:
    """Replace the checkpoint's state.json (a document, or raw bytes) and/or manifest fields, then recompute
    every declared file's size and SHA-256 and the checkpoint_id, independently of the publisher's code."""
    current = json.loads((path / checkpoint_dir.MANIFEST).read_bytes())
    if manifest is not None:
        current = manifest
    if state_raw is not None:
        (path / "state.json").write_bytes(state_raw)
    elif state is not None:
        (path / "state.json").write_bytes(_canonical(state))
    (path / checkpoint_dir.MANIFEST).write_bytes(publisher_manifest(current, path))
