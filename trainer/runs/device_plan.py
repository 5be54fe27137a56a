"""What a run or an evaluation plans to hold on a CUDA device: the bytes backend selection compares with the device's
free memory (trainer.runs.backend.cuda_unavailable), at admission and again when a worker dequeues the work.

A plan is trainer.cuda_model.planned_device_bytes for every model the workload puts on the device (SFT's and GRPO's
training step; OPD's student, which samples, scores and trains, and its native teacher's own device model; an
evaluation's generating model), plus CUDA_CONTEXT_BYTES for the process's CUDA context. Where the request alone
cannot give a length, the plan takes the bound the run itself cannot exceed (the base's context). A plan that
cannot be computed at all is an Unplannable need, which every free-memory check refuses, so cuda is never chosen
for it. A plan that can be computed is a DeviceNeed: the bytes, and the head size of each model's attention (the
tiled kernels' shared memory per block grows with it, and a device may allow too little for it).
"""

from dataclasses import replace

from trainer import LoraConfig
from trainer.config import TransformerConfig
from trainer.cuda_model import planned_device_bytes
from trainer.runs.loss_chunks import loss_options

# The CUDA context of the process that computes, which trainer.cuda_model.planned_device_bytes does not count: the
# driver's per-context reservations (the local memory of every thread the device can hold resident, the printf and
# malloc heaps), the kernel images of libkiln_cuda.so and of the cuBLAS/cuBLASLt kernels it runs (loaded lazily
# since CUDA 12.2), and what cuBLAS holds besides the fixed BLAS_WORKSPACE_BYTES (32 MiB) each device model hands
# it with cublasSetWorkspace, which the model's plan already counts: the handle's state and the default workspace
# pool cublasCreate sets up (NVIDIA's recommended size: 32 MiB on Hopper, 4 MiB before). A process that has only
# initialised CUDA and cuBLAS is commonly reported at 300-500 MiB on Ampere and Hopper GPUs under CUDA 12; 512 MiB
# covers that. Not yet measured with this library on a GPU (bench/cuda_check.sh is where to measure it). It is
# counted once per plan: one process, one context, however many device models it holds.
CUDA_CONTEXT_BYTES = 512 << 20
UNPLANNABLE_BYTES = 1 << 62  # an Unplannable need's value: more than any device holds


class Unplannable(int):
    """The need of a workload whose device memory cannot be planned (`reason` says why): more bytes than any device
    has, so the free-memory check refuses cuda for it (explicit cuda: backend_unavailable; auto: cpu), and written
    as its reason where that check says what the run plans."""

    def __new__(cls, reason: str):
        need = super().__new__(cls, UNPLANNABLE_BYTES)
        need.reason = reason
        return need

    def __str__(self) -> str:
        return f"an amount that cannot be known: {self.reason}"

    def __format__(self, spec: str) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"Unplannable({self.reason!r})"


class DeviceNeed(int):
    """The bytes a workload plans on the device, with the attention it computes there: `attention`, a tuple of
    (head size, training) pairs, training True for a model that trains (the attention's forward and backward
    kernels) and False for one that only runs forward (cached decoding, a teacher's scores). `head_size` is the
    largest. backend.cuda_unavailable refuses a device whose attention_head_size_limit (native_ext.cuda's probe) is
    below one of them; as bytes it is the int it plans."""

    def __new__(cls, nbytes: int, attention):
        need = super().__new__(cls, int(nbytes))
        need.attention = tuple(sorted({(int(head_size), bool(training)) for head_size, training in attention}))
        assert need.attention, "a device need names the attention it computes"
        return need

    @property
    def head_size(self) -> int:
        return max(head_size for head_size, _ in self.attention)

    def __reduce__(self):
        return DeviceNeed, (int(self), self.attention)

    def __str__(self) -> str:  # written as the bytes it plans, as a plain int is
        return str(int(self))

    def __repr__(self) -> str:
        return f"DeviceNeed({int(self)}, attention={self.attention!r})"


def architecture(base, route: str | None = "kt_tape_flce"):
    """BASE's TransformerConfig with the loss options of ROUTE (the cuda backend's route; None: the defaults, for a
    model that takes no step), or None when the base does not describe its architecture."""
    described = getattr(base, "config", None)
    if not isinstance(described, dict) or not described:
        return None
    try:
        model = TransformerConfig.from_dict(described)
    except (TypeError, ValueError):
        return None
    if route is None:
        return model
    return replace(model, **loss_options(route, model.vocabulary_size))


def _undescribed(base) -> Unplannable:
    return Unplannable(f"base {getattr(base, 'name', None) or '(unnamed)'} does not describe its architecture, so "
                       "its device memory cannot be planned")


def lora_of(config: dict):
    """The request's LoRA shape (config.lora) as a LoraConfig, or None (the whole base trains)."""
    lora = config.get("lora")
    return None if lora is None else LoraConfig(rank=lora["rank"], alpha=lora["alpha"], targets=tuple(lora["targets"]))


def run_bytes(config: dict, base) -> int:
    """trainer.runs.admission.planned_device_bytes: the plan the effective configuration CONFIG alone gives over
    BASE (a BaseInfo): SFT's (sft_bytes), OPD's with its prompts and teacher
    at their bounds (opd_bytes), and an Unplannable need for a GRPO run (a group's size is in its data alone) or a
    base without an architecture."""
    if "max_completion_length" in config:
        return grpo_bytes(config, base)
    if "max_new_tokens" in config:
        return opd_bytes(config, base)
    return sft_bytes(config, base)


def sft_bytes(config: dict, base) -> int:
    """An SFT run's micro-batch: batch_size sequences of max_sequence_length tokens (at most the base's context), a
    training step of them, plus the context."""
    model = architecture(base)
    if model is None:
        return _undescribed(base)
    positions = min(int(config.get("max_sequence_length") or model.maximum_context), model.maximum_context)
    return DeviceNeed(CUDA_CONTEXT_BYTES + planned_device_bytes(model, int(config.get("batch_size") or 1), positions,
                                                                lora_of(config), config.get("quantization")),
                      [(model.head_dimension, True)])


def grpo_bytes(config: dict, base, group=None) -> int:
    """A GRPO run's micro-batch is one whole group (trainer.runs.grpo.group_batch): one row a completion, each the
    prompt and the group's longest completion less one token. GROUP is (rows, positions) of the dataset's largest
    (rows x positions) group, as admission reads it; without it the plan is Unplannable, since no configuration
    field bounds a group's size. A training step of it, plus the context."""
    model = architecture(base)
    if model is None:
        return _undescribed(base)
    if group is None:
        return Unplannable("a GRPO run's micro-batch is one whole group, whose size only its groups give")
    rows, positions = group
    return DeviceNeed(CUDA_CONTEXT_BYTES + planned_device_bytes(model, int(rows), min(int(positions),
                                                                                       model.maximum_context),
                                                                lora_of(config)),
                      [(model.head_dimension, True)])


def opd_bytes(config: dict, base, prompt: int | None = None, teacher=None) -> int:
    """An OPD run samples each candidate (generate: a KV cache of the prompt and max_new_tokens, at most the base's
    context, and the prefill's decoding scratch), scores the sample with CudaModel.logits (its whole [T,V] logits),
    then trains on it: one sequence of T = cache positions - 1 tokens. PROMPT is the longest prompt in tokens (None:
    the bound, the context less one). TEACHER is a native teacher's (BaseInfo, LoraConfig or None): its own device
    model, which scores the same T tokens with logits and never steps (an endpoint teacher holds nothing here);
    None for a native teacher is Unplannable. The context is counted once: one process holds both."""
    model = architecture(base)
    if model is None:
        return _undescribed(base)
    context = model.maximum_context
    prompt = context - 1 if prompt is None else min(int(prompt), context - 1)
    cached = min(prompt + int(config.get("max_new_tokens") or 1), context)
    need = CUDA_CONTEXT_BYTES + planned_device_bytes(model, 1, cached - 1, lora_of(config), config.get("quantization"),
                                                     logits=True, sampling=(prompt, cached))
    if (config.get("teacher") or {}).get("route") != "native":
        return DeviceNeed(need, [(model.head_dimension, True)])
    if teacher is None:
        return Unplannable("an OPD run's native teacher puts its own model on the device, and the plan was not "
                           "given the teacher's base")
    teacher_base, teacher_lora = teacher
    teacher_model = architecture(teacher_base, None)
    if teacher_model is None:
        return _undescribed(teacher_base)
    return DeviceNeed(need + planned_device_bytes(teacher_model, 1, cached - 1, teacher_lora, training=False,
                                                  logits=True),
                      [(model.head_dimension, True), (teacher_model.head_dimension, False)])


def evaluation_bytes(base, lora=None, max_new_tokens: int = 64, prompt: int | None = None) -> int:
    """An evaluation's plan: greedy generation (generate's KV cache of the prompt and max_new_tokens, at most the
    base's context, and the prefill's decoding scratch) by one model at a time on the device, the larger of the
    candidate (BASE with the adapter LORA, a LoraConfig) and the base alone (a baseline that is the base: with no
    adapter, its device model holds the dense base's gradient buffers too), plus the context. PROMPT is the longest
    prompt in tokens (None: the bound, the context less one)."""
    model = architecture(base, None)
    if model is None:
        return _undescribed(base)
    context = model.maximum_context
    prompt = context - 1 if prompt is None else min(int(prompt), context - 1)
    sampling = (prompt, min(prompt + int(max_new_tokens), context))
    return DeviceNeed(CUDA_CONTEXT_BYTES + max(planned_device_bytes(model, 0, 0, adapter, training=False,
                                                                    sampling=sampling) for adapter in (lora, None)),
                      [(model.head_dimension, False)])


def record(need: int) -> dict:
    """What a job records of its plan (identities.device_plan), so that a worker rechecks the device at dequeue
    without loading anything: {"bytes": the plan, "attention": [{"head_size", "training"}, ...] (a DeviceNeed's), or
    "bytes" None with "unplannable": why}."""
    if isinstance(need, Unplannable):
        return {"bytes": None, "unplannable": need.reason}
    if isinstance(need, DeviceNeed):
        return {"bytes": int(need), "attention": [{"head_size": head_size, "training": training}
                                                  for head_size, training in need.attention]}
    return {"bytes": int(need)}


def recorded(identities) -> int | None:
    """The need a job's identities record (record's inverse); None for a job admitted before plans were recorded."""
    plan = identities.get("device_plan") if isinstance(identities, dict) else None
    if not isinstance(plan, dict):
        return None
    if plan.get("unplannable"):
        return Unplannable(str(plan["unplannable"]))
    need = plan.get("bytes")
    if not isinstance(need, int) or isinstance(need, bool):
        return None
    attention = plan.get("attention")
    if isinstance(attention, list) and attention:  # a job admitted before head sizes were recorded: bytes alone
        return DeviceNeed(need, [(int(entry["head_size"]), bool(entry["training"])) for entry in attention])
    return need
