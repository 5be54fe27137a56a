"""One qualification run in a process of its own: `python -m trainer.qualify_child SPEC.json RECEIPT.json`.

SPEC (JSON): {"route", "phase", "kind", "home", "bases_root", "backend", "request", "cancel_at"}; the request
is admitted, revalidated (as at dequeue) and run with nothing but what is on disk (a resume names its
checkpoint in the request), cancelled after `cancel_at` committed steps when that is not null. RECEIPT (JSON,
written when the run ends) is what trainer.qualify compares between processes: what the process loaded (base,
tokenizer, dataset, teacher, the resume checkpoint), the checkpoints it published, its execution identity, the
exact loss history, and SHA-256 digests of the final adapter, the optimizer moments and every file of the
final checkpoint and of the final adapter snapshot; the optimizer's scalar state is recorded as it is.

Test knob (never set it outside tests): KILN_QUALIFY_TEST_PLANT=ROUTE:PHASE makes that one process add 1e-3 to
one gradient value (an adapter value on a device) in the first step it takes, a difference that lives in this process's memory only, so that a
test can prove qualification catches it.
"""

import hashlib
import importlib
import json
import os
import sys
from pathlib import Path

import numpy as np

CHILD_SCHEMA = "kiln.qualification-child.v1"
PLANT_ENV = "KILN_QUALIFY_TEST_PLANT"


class ChildHooks:
    """Cancels after `cancel_at` committed steps (None: never); records the checkpoints this process publishes."""

    def __init__(self, cancel_at):
        self.cancel_at, self.seen, self.checkpoints = cancel_at, 0, []

    def on_step(self, metrics):
        self.seen = metrics["step"]

    def should_cancel(self):
        return self.cancel_at is not None and self.seen >= self.cancel_at

    def on_checkpoint(self, summary, timing):
        self.checkpoints.append({key: summary[key] for key in
                                 ("step", "resume_checkpoint", "checkpoint_id", "manifest_sha256")})

    def on_event(self, level, message):
        pass


def sha256(data) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()


def plant(module) -> None:
    """The test knob: the first step this process takes has one value moved by 1e-3, a gradient on the CPU engine
    (an adapter value on a device model), through the run kind MODULE's step (trainer.runs.device.step_on)."""
    from trainer.runs.device import on_device

    real = module.step_on
    done = []

    def step_on(computing, config, optimizer, adapters, step, total_steps, loss):
        if not done:
            done.append(step)
            if on_device(computing):
                values = computing.adapter_state_dict()
                first = next(iter(values))
                values[first].reshape(-1)[0] += np.float32(1e-3)
                computing.load_adapter_state_dict(values)
            else:
                adapters[0].grad.reshape(-1)[0] += np.float32(1e-3)
        return real(computing, config, optimizer, adapters, step, total_steps, loss)

    module.step_on = step_on


def outcome(settings, kind, adapter: str, result) -> dict:
    """Digests of the final checkpoint (every file; adapter and optimizer moments as canonical bytes), the final
    adapter snapshot's files, and the optimizer's scalar state."""
    from trainer.runs import checkpoint_dir
    from trainer.runs.state import ADAPTER_FILE, OPTIMIZER_FILE, STATE_FILE

    latest = checkpoint_dir.latest_checkpoint(settings.registry, adapter)
    loaded = checkpoint_dir.load_checkpoint(latest, full=True, allowed_manifest_fields=kind.manifest_fields)
    snapshot = settings.registry / adapter
    return {
        "status": result.status,
        "steps": result.steps_completed,
        "loss_history_sha256": sha256(json.dumps(result.loss_history).encode()),
        "final_checkpoint": latest.name,
        "checkpoint_id": loaded.checkpoint_id,
        "adapter_sha256": sha256(loaded.read(ADAPTER_FILE)),
        "optimizer_moments_sha256": sha256(loaded.read(OPTIMIZER_FILE)),
        "optimizer_scalars": json.loads(bytes(loaded.read(STATE_FILE)))["optimizer"],
        "checkpoint_files": {p.name: sha256(p.read_bytes()) for p in sorted(latest.iterdir())},
        "final_adapter": {p.name: sha256(p.read_bytes()) for p in sorted(snapshot.iterdir())}
        if snapshot.is_dir() else {},
    }


def run(spec: dict) -> dict:
    from trainer.runs import RUN_KINDS, run_kind
    from trainer.runs.admission import RunSettings

    home, bases_root = Path(spec["home"]), Path(spec["bases_root"])
    settings = RunSettings(home=home, registry=home / "adapters", bases_root=bases_root,
                           data_roots=(home / "datasets",), backend=spec.get("backend", "cpu"))
    if os.environ.get(PLANT_ENV) == f"{spec['route']}:{spec['phase']}":
        plant(importlib.import_module(RUN_KINDS[spec["kind"]]))
    kind = run_kind(spec["kind"])
    admission = kind.admit(spec["request"], settings)
    kind.revalidate(admission, settings)  # as a worker does at dequeue: a resume proves its checkpoint again
    hooks = ChildHooks(spec.get("cancel_at"))
    result = kind.run(admission, settings, hooks)
    identities = admission.identities
    config = {k: v for k, v in admission.effective_config.items() if k != "resume_checkpoint"}
    return {
        "schema": CHILD_SCHEMA,
        "route": spec["route"],
        "phase": spec["phase"],
        "process": {"pid": os.getpid(), "python": sys.executable},
        "status": result.status,
        "steps_completed": result.steps_completed,
        "loss_history": result.loss_history,
        "loaded": {**{k: v for k, v in identities.items() if k != "execution"}, "resume": admission.resume,
                   "data_source": admission.data_source_kind},
        "checkpoints": hooks.checkpoints,
        "execution": identities["execution"],
        "seed": admission.effective_seed,
        "configuration": config,
        "outcome": outcome(settings, kind, admission.adapter, result),
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m trainer.qualify_child SPEC.json RECEIPT.json", file=sys.stderr)
        return 2
    receipt = run(json.loads(Path(argv[0]).read_text()))
    Path(argv[1]).write_text(json.dumps(receipt, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
