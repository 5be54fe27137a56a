"""Every training kind's request defaults: the configuration a request's fields update.

Plain data, one copy. Each kind's RunKind carries its dict as `defaults`; admission merges a
request over it (trainer.runs.admission.merge_config), and the web side's request schemas
describe each absent field from it (`default_at`), so the API reference cannot drift from
what admission does.
"""

from trainer.lora import PROJECTIONS

LORA_DEFAULT = {"rank": 8, "alpha": 16.0, "targets": list(PROJECTIONS), "use_rslora": False}
SCHEDULE_DEFAULT = {"type": "constant", "warmup_steps": 0}
# Adam's hyperparameters (torch.optim.AdamW's defaults but no weight decay, as every run has used): part of the
# effective configuration, so a resume with others is refused field by field
OPTIMIZER_DEFAULT = {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "weight_decay": 0.0}
NF4_DEFAULT = {"type": "nf4", "block_size": 64, "double_quantization": False}  # bitsandbytes' blocksize 64
EMA_DEFAULTS = {"refresh_steps": 512, "mixup_alpha": 0.6}  # TRL ref_model_sync_steps / ref_model_mixup_alpha
GUARDRAIL_DEFAULTS = {"entropy_floor": None, "max_repetition_rate": None, "max_empty_rate": None,
                      "kl_ceiling": None, "window": 8}
OPD_CHECKPOINT_INTERVAL = 25  # OPD's request default (the spec's)

SFT_DEFAULTS = {
    "output_name": None,
    "base_model": None,  # the server's default base (RunSettings.default_base)
    "epochs": 1,
    "learning_rate": 2e-4,
    "lr_schedule": SCHEDULE_DEFAULT,
    "batch_size": 1,
    "gradient_accumulation_steps": 1,
    "max_grad_norm": 1.0,
    "optimizer": OPTIMIZER_DEFAULT,
    "lora": LORA_DEFAULT,
    "quantization": None,  # an FP32 base (LoRA); NF4_DEFAULT fills a {type: nf4} request
    "seed": None,
    "checkpoint_interval": None,  # the server's training.checkpoint_interval
    "resume_checkpoint": None,
    "max_sequence_length": 512,
    "base_adapter": None,  # a PEFT directory: weights-only warm start
    "activation_checkpointing": "none",
    "backend": None,  # the server's KILN_TRAINING_BACKEND (auto, cpu or cuda); the effective one is resolved
    "precision": None,  # float32; or bfloat16 (a LoRA base's products: oneDNN on cpu, BF16 tensor cores on cuda) or
    # tfloat32 (cuda only): written only when not float32
}

GRPO_DEFAULTS = {
    "output_name": None,
    "base_model": None,  # the server's default base (RunSettings.default_base)
    "learning_rate": 1e-5,  # LoRA needs more than TRL's full-model 1e-6
    "lr_schedule": SCHEDULE_DEFAULT,
    "epochs": 1,
    "groups_per_step": 1,  # micro-batches (groups) accumulated into one optimizer step
    "max_grad_norm": 1.0,  # TRL / transformers default
    "optimizer": OPTIMIZER_DEFAULT,
    "lora": LORA_DEFAULT,
    "seed": None,
    "checkpoint_interval": None,  # the server's training.checkpoint_interval
    "resume_checkpoint": None,
    "epsilon": 0.2,  # TRL
    "epsilon_high": None,  # None: epsilon (symmetric clipping)
    "beta": 0.0,  # TRL: no KL term, no reference forward
    "scale_rewards": "group",  # TRL
    "loss_type": "dapo",  # TRL's current default
    "num_iterations": 1,  # TRL's mu
    "max_completion_length": 256,  # TRL through 1.9; completions are truncated to it; dr_grpo divides by it
    "reference": {"type": "frozen"},  # {type: ema} takes EMA_DEFAULTS
    "streaming": False,
    "base_adapter": None,  # a PEFT directory: weights-only warm start
    "activation_checkpointing": "none",
    "backend": None,  # the server's KILN_TRAINING_BACKEND (auto, cpu or cuda); the effective one is resolved
    "precision": None,  # float32; or bfloat16 (a LoRA base's products: oneDNN on cpu, BF16 tensor cores on cuda) or
    # tfloat32 (cuda only): written only when not float32
}

OPD_DEFAULTS = {
    "output_name": None,
    "base_model": None,  # the server's default base (RunSettings.default_base)
    "teacher": None,  # the resolved alias spec (trainer.teachers.parse_teacher)
    "max_new_tokens": 64,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "stop_strings": [],
    "learning_rate": 1e-4,
    "lr_schedule": SCHEDULE_DEFAULT,
    "steps": 100,
    "candidates_per_step": 1,  # completions with an update accumulated into one optimizer step
    "max_grad_norm": 1.0,
    "optimizer": OPTIMIZER_DEFAULT,
    "lora": LORA_DEFAULT,
    "seed": None,
    "checkpoint_interval": OPD_CHECKPOINT_INTERVAL,
    "resume_checkpoint": None,
    "base_adapter": None,  # a PEFT directory: weights-only warm start
    "guardrails": GUARDRAIL_DEFAULTS,
    "activation_checkpointing": "none",
    "backend": None,  # the server's KILN_TRAINING_BACKEND (auto, cpu or cuda); the effective one is resolved
    "precision": None,  # float32; or bfloat16 (a LoRA base's products: oneDNN on cpu, BF16 tensor cores on cuda) or
    # tfloat32 (cuda only): written only when not float32
}

DEFAULTS = {"sft": SFT_DEFAULTS, "grpo": GRPO_DEFAULTS, "opd": OPD_DEFAULTS}
# nested objects whose own defaults apply once the request gives the object (null or absent as a whole)
NESTED_DEFAULTS = {"quantization": NF4_DEFAULT, "reference": EMA_DEFAULTS}


def default_at(kind: str, path: str):
    """The default of request field PATH ("lora.rank", "reference.refresh_steps") of training KIND;
    KeyError when the kind has no such field."""
    head, _, rest = path.partition(".")
    value = DEFAULTS[kind][head]
    for name in rest.split(".") if rest else ():
        if not isinstance(value, dict) or name not in value:
            value = NESTED_DEFAULTS[head]
        value = value[name]
    return value
