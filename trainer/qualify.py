"""Qualification: fresh-repeat and cancel-then-resume equivalence on this backend.

For each public route (SFT, inline GRPO, streamed GRPO, OPD with a native teacher) on
the built-in kiln-tiny base: run once uninterrupted, run again from scratch, and run a
third time cancelled mid-way and resumed from its checkpoint. The three must agree
byte for byte on the loss history, the final checkpoint (every file, manifest
included), the final adapter and the loop state. The receipt records the execution
envelope the evidence holds for: model, executable, backend, device, runtime,
precision, kernels, tokenizer and template, configuration, data and seed.
"""

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

from trainer import teachers
from trainer.runs import checkpoint_dir, grpo, opd, sft
from trainer.runs.admission import RunSettings

RECEIPT_SCHEMA = "kiln.qualification-receipt.v1"
SFT_RECORDS = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                             {"role": "assistant", "content": f"{a + b}."}]}
               for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4)]]
GROUPS = [{"prompt": f"Q: {i} times 3 =", "completions": [
    {"text": f" {3 * i}.", "reward": 1.0}, {"text": f" {3 * i + 1}, I think", "reward": 0.0},
    {"text": " I cannot say", "reward": 0.2}]} for i in range(4)]
PROMPTS = ["Hello", "Tell me a story about", "What is 2 plus 2?"]


class _Stop:
    def __init__(self, step):
        self.step, self.seen = step, 0

    def on_step(self, metrics):
        self.seen = metrics["step"]

    def should_cancel(self):
        return self.step is not None and self.seen >= self.step

    def on_checkpoint(self, summary, timing):
        pass

    def on_event(self, level, message):
        pass


def _routes(home: Path):
    datasets = home / "datasets"
    stream = datasets / "groups.jsonl"
    stream.write_text("".join(json.dumps(g) + "\n" for g in GROUPS))
    teacher = {"alias": "qualifier@native", "route": "native", "base": "kiln-tiny", "adapter": None}
    teacher["identity_revision"] = teachers.identity_revision(teacher)
    common = {"seed": 3, "checkpoint_interval": 1, "lora": {"rank": 4, "alpha": 8}}
    return {
        "sft": (sft.admit_sft, sft.run_sft, 3, {"data": SFT_RECORDS, "config": {
            **common, "output_name": "q-sft", "epochs": 2, "batch_size": 2, "learning_rate": 5e-3}}),
        "grpo_inline": (grpo.admit_grpo, grpo.run_grpo, 2, {"groups": GROUPS, "config": {
            **common, "output_name": "q-grpo", "epochs": 2, "groups_per_step": 2, "learning_rate": 2e-2,
            "beta": 0.05}}),
        "grpo_streamed": (grpo.admit_grpo, grpo.run_grpo, 2, {"dataset_path": str(stream), "config": {
            **common, "output_name": "q-stream", "epochs": 2, "groups_per_step": 1, "learning_rate": 2e-2,
            "streaming": True}}),
        "opd": (opd.admit_opd, opd.run_opd, 2, {"prompts": PROMPTS, "config": {
            **common, "output_name": "q-opd", "teacher": teacher, "steps": 4, "max_new_tokens": 6,
            "learning_rate": 2e-2}}),
    }


def _settings(home: Path, bases_root: Path) -> RunSettings:
    (home / "datasets").mkdir(parents=True, exist_ok=True)
    (home / "adapters").mkdir(parents=True, exist_ok=True)
    return RunSettings(home=home, registry=home / "adapters", bases_root=bases_root,
                       data_roots=(home / "datasets",))


def _outcome(settings, adapter, result) -> dict:
    """Digests of everything that must agree (final checkpoint files, adapter, losses)."""
    latest = checkpoint_dir.latest_checkpoint(settings.registry, adapter)
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(latest.iterdir())}
    snapshot = settings.registry / adapter
    final = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(snapshot.iterdir())} \
        if snapshot.is_dir() else {}
    losses = hashlib.sha256(json.dumps(result.loss_history).encode()).hexdigest()
    return {"status": result.status, "steps": result.steps_completed, "loss_history_sha256": losses,
            "final_checkpoint": latest.name, "checkpoint_files": files, "final_adapter": final}


def _prepared(request, home: Path) -> dict:
    """The request with its dataset file copied into this run's own data root."""
    req = json.loads(json.dumps(request))
    if "dataset_path" in req:
        source = Path(request["dataset_path"])
        shutil.copy(source, home / "datasets" / source.name)
        req["dataset_path"] = str(home / "datasets" / source.name)
    return req


def _qualify_route(name, admit, run, cancel_at, request, work: Path, bases_root: Path) -> dict:
    outcomes = {}
    adapter = request["config"]["output_name"]
    started = time.perf_counter()
    for label in ("first", "repeat"):
        settings = _settings(work / f"{name}-{label}", bases_root)
        req = _prepared(request, settings.home)
        outcomes[label] = _outcome(settings, adapter, run(admit(req, settings), settings, _Stop(None)))
    settings = _settings(work / f"{name}-resumed", bases_root)
    req = _prepared(request, settings.home)
    admission = admit(req, settings)
    first = run(admission, settings, _Stop(cancel_at))
    if first.status != "cancelled" or first.latest_checkpoint is None:
        raise RuntimeError(f"{name}: the run did not stop with a checkpoint at step {cancel_at}")
    resumed_request = {**req, "config": {**req["config"],
                                         "resume_checkpoint": first.latest_checkpoint["resume_checkpoint"]}}
    outcomes["resumed"] = _outcome(settings, adapter, run(admit(resumed_request, settings), settings, _Stop(None)))
    mismatches = [f"{label}.{key}" for label in ("repeat", "resumed") for key in outcomes["first"]
                  if outcomes[label][key] != outcomes["first"][key]]
    return {"route": name, "passed": not mismatches, "mismatches": mismatches, "cancelled_at": cancel_at,
            "seconds": round(time.perf_counter() - started, 3), "outcome": outcomes["first"],
            "configuration": admission.to_json()["effective_config"],
            "seed": admission.to_json()["effective_seed"]}


def qualify(backend="cpu", output=None, routes=None, progress=print) -> dict:
    """Run the qualification; returns (and writes, when `output` is given) the receipt."""
    if backend != "cpu":
        raise RuntimeError(f"backend {backend!r} is not available in this build; qualify runs on cpu")
    from trainer.bases import load_base, show_base
    with tempfile.TemporaryDirectory(prefix="kiln-qualify-") as directory:
        work = Path(directory)
        bases_root = work / "bases-root"
        model, tokenizer = load_base("kiln-tiny", bases_root)
        model.close()
        shared = _settings(work / "shared", bases_root)
        results = []
        for name, (admit, run, cancel_at, request) in _routes(shared.home).items():
            if routes and name not in routes:
                continue
            progress(f"qualifying {name} ...")
            result = _qualify_route(name, admit, run, cancel_at, request, work, bases_root)
            progress(f"  {name}: {'passed' if result['passed'] else 'FAILED ' + ', '.join(result['mismatches'])}"
                     f" ({result['seconds']:.1f} s)")
            results.append(result)
        base = show_base("kiln-tiny", bases_root)
        receipt = {
            "schema": RECEIPT_SCHEMA,
            "passed": all(r["passed"] for r in results),
            "backend": backend,
            "envelope": {
                "model": {"name": "kiln-tiny", "identity": base.identity, "config": base.config},
                "execution": sft.execution_identity(backend),
                "tokenizer": tokenizer.identity(),
                "data": {r["route"]: r["outcome"]["loss_history_sha256"] for r in results},
            },
            "routes": results,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "note": ("Repeatability holds inside this envelope only; it is no claim of identical training "
                     "across devices, backends, builds, drivers or machines."),
        }
    if output is not None:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(receipt, indent=1, sort_keys=True) + "\n")
    return receipt
