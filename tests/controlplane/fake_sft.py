"""A fast stand-in for trainer.runs.sft with the same interface, for control-plane tests.

Selected with KILN_SFT_RUNNER=controlplane.fake_sft (tests/ on sys.path). It publishes
real (tiny) `.kiln-checkpoint`s through trainer.runs.checkpoint_dir, so status reads and
resume admission use the real loader. Knobs, all in the request:
  records {"fail": "boom"} -> the run raises RuntimeError at that record's step
  config.base_model "missing" -> AdmissionError base_not_found
  config.base_model "bad-request" -> RequestError on config.base_model
KILN_FAKE_STEP_SECONDS (environment): sleep per step, so a run can be cancelled mid-way.
"""

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.runs import checkpoint_dir
from trainer.runs.checkpoint_dir import CheckpointError
from trainer.runs.admission import Admission as SFTAdmission
from trainer.runs.kind import RunKind
from trainer.runs.state import RunResult

MANIFEST_FIELDS = {"training", "config", "seed", "progress"}


class RequestError(ValueError):
    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field, self.message = field_name, message


class AdmissionError(Exception):
    def __init__(self, code: str, message: str, differences=None):
        super().__init__(message)
        self.code, self.message, self.differences = code, message, list(differences or [])


@dataclass(frozen=True)
class RunSettings:
    home: Path
    registry: Path
    bases_root: Path
    data_roots: tuple = ()
    default_checkpoint_interval: int | None = None
    default_base: str = "kiln-tiny"
    backend: str = "cpu"


def _records(request, settings):
    if request.get("data") is not None:
        return list(request["data"]), "inline"
    path = Path(request["dataset_path"]).resolve()
    roots = (settings.home / "datasets", *settings.data_roots)
    if not any(path.is_relative_to(Path(root).resolve()) for root in roots):
        raise AdmissionError("dataset_outside_roots", f"{path} is outside the data roots")
    if not path.is_file():
        raise AdmissionError("dataset_not_found", f"{path} is not a file")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()], "file"


def _load(reference, adapter, settings):
    try:
        path = checkpoint_dir.resolve_checkpoint(settings.registry, reference)
        return checkpoint_dir.load_checkpoint(path, full=True, expected_type="sft", expected_adapter=adapter,
                                              allowed_manifest_fields=MANIFEST_FIELDS)
    except CheckpointError as error:
        raise AdmissionError(error.code, str(error)) from None


def admit_sft(request: dict, settings: RunSettings) -> SFTAdmission:
    config = dict(request["config"])
    if config.get("base_model") == "missing":
        raise AdmissionError("base_not_found", "no base named 'missing'; kiln base list shows the registered ones")
    if config.get("base_model") == "bad-request":
        raise RequestError("config.base_model", "is not acceptable to the fake")
    records, kind = _records(request, settings)
    interval = config.get("checkpoint_interval") or settings.default_checkpoint_interval
    effective = {"output_name": config["output_name"], "epochs": config.get("epochs") or 1,
                 "checkpoint_interval": interval, "learning_rate": config.get("learning_rate") or 2e-4}
    seed = config.get("seed")
    resume = None
    dataset = hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()
    if config.get("resume_checkpoint"):
        loaded = _load(config["resume_checkpoint"], config["output_name"], settings)
        differences = []
        if loaded.manifest["config"]["learning_rate"] != effective["learning_rate"]:
            differences.append({"field": "config.learning_rate", "checkpoint": loaded.manifest["config"][
                "learning_rate"], "request": effective["learning_rate"]})
        if seed is not None and seed != loaded.manifest["seed"]:
            differences.append({"field": "seed", "checkpoint": loaded.manifest["seed"], "request": seed})
        if differences:
            raise AdmissionError("resume_drift", f"the request differs from the checkpoint in {len(differences)} "
                                 "field(s)", differences)
        seed = loaded.manifest["seed"]
        resume = {"checkpoint": loaded.path.name, "checkpoint_id": loaded.checkpoint_id,
                  "manifest_digest": loaded.manifest_digest, "seed": seed,
                  "step": loaded.manifest["progress"]["committed_step"]}
    seed = 1234 if seed is None else seed
    effective["seed"] = seed
    return SFTAdmission(kind="sft", adapter=config["output_name"], request=request, effective_config=effective,
                        effective_seed=seed, data_source_kind=kind, total_steps=len(records) * effective["epochs"],
                        identities={"base": {"name": "fake"}, "dataset": {"sha256": dataset}, "tokenizer": {},
                                    "execution": {"backend": settings.backend}, "planning": {}},
                        resume=resume)


def revalidate_sft(admission: SFTAdmission, settings: RunSettings) -> None:
    if admission.resume is None:
        return
    loaded = _load(admission.resume["checkpoint"], admission.adapter, settings)
    if loaded.manifest_digest != admission.resume["manifest_digest"]:
        raise AdmissionError("checkpoint_changed", "the resume checkpoint changed after admission",
                             [{"field": "manifest_digest", "checkpoint": loaded.manifest_digest,
                               "request": admission.resume["manifest_digest"]}])


def _publish(admission, settings, step, complete, hooks):
    timing = {"lock_wait_seconds": 0.0, "snapshot_seconds": 0.0}
    records = len(admission.request.get("data") or []) or 1
    manifest = {"training": {"kind": "sft"}, "config": admission.effective_config, "seed": admission.effective_seed,
                "progress": {"data_source_kind": admission.data_source_kind, "committed_step": step,
                             "total_steps": admission.total_steps,
                             "next_cursor": {"epoch": step // records, "example": step % records},
                             "complete": complete}}
    path = checkpoint_dir.publish_checkpoint(settings.registry, admission.adapter, step, checkpoint_type="sft",
                                             files={"state.json": json.dumps({"step": step}).encode()},
                                             manifest=manifest, on_timing=timing.update)
    summary = checkpoint_dir.checkpoint_summary(checkpoint_dir.load_checkpoint(path, full=False))
    hooks.on_checkpoint(summary, timing)
    hooks.on_event("info", f"published {path.name}")
    return summary


def run_sft(admission: SFTAdmission, settings: RunSettings, hooks) -> RunResult:
    step, latest, losses = 0, None, []
    if admission.resume is not None:
        loaded = _load(admission.resume["checkpoint"], admission.adapter, settings)
        step = loaded.manifest["progress"]["committed_step"]
        latest = checkpoint_dir.checkpoint_summary(loaded)
    records = admission.request.get("data") or [{}] * admission.total_steps
    interval = admission.effective_config["checkpoint_interval"]
    pause = float(os.environ.get("KILN_FAKE_STEP_SECONDS") or 0)
    while step < admission.total_steps:
        record = records[step % len(records)]
        if isinstance(record, dict) and record.get("fail"):
            raise RuntimeError(record["fail"])
        time.sleep(pause)
        step += 1
        loss = 1.0 / step
        losses.append(loss)
        hooks.on_step({"step": step, "loss": loss, "learning_rate": 2e-4, "grad_norm": 0.5, "clipped": False,
                       "loss_spike": False, "tokens": 10, "epoch": 0, "elapsed_seconds": 0.01 * step})
        done = step >= admission.total_steps
        cancel = not done and hooks.should_cancel()
        if interval and (step % interval == 0 or done or cancel):
            latest = _publish(admission, settings, step, done, hooks)
        if cancel:
            return RunResult("cancelled", step, latest, losses)
    return RunResult("succeeded", step, latest, losses)


# late-bound, so a test that monkeypatches admit_sft / revalidate_sft / run_sft here is heard
RUN_KIND = RunKind(name="sft", admit=lambda request, settings: admit_sft(request, settings),
                   revalidate=lambda admission, settings: revalidate_sft(admission, settings),
                   run=lambda admission, settings, hooks: run_sft(admission, settings, hooks),
                   admission_from_json=SFTAdmission.from_json, manifest_fields=MANIFEST_FIELDS)
