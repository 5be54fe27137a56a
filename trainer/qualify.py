"""Qualification: fresh-repeat and cancel-then-resume equivalence on this backend, each run in its own process.

For each public route (SFT, inline GRPO, streamed GRPO, OPD with a native teacher) on the built-in kiln-tiny
base, four fresh Python processes (trainer.qualify_child) run: the first run, a repeat from scratch, a run
cancelled mid-way, and the resume of that run from its checkpoint. Nothing but the files on disk passes from
one to the next, so state that survives only in memory cannot make them agree. The parent compares the
children's receipts: the loss history exactly, the final checkpoint (every file, adapter and optimizer moments
as canonical bytes, manifest included), the final adapter snapshot, the optimizer's scalar state, the
checkpoints each published (ids and manifest digests), what each loaded (base, tokenizer, dataset, teacher,
the resume checkpoint), the execution identity, the seed and the configuration. A mismatch names the route and
the first field that differs. The receipt records the execution envelope the evidence holds for: model,
executable, backend, device, runtime, precision, kernels, tokenizer and template, and the SHA-256 and record
count of the exact dataset bytes each route trained on.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainer import teachers

from trainer.runs.backend import RECEIPT_SCHEMA, BackendUnavailable, require_cuda  # noqa: F401 (read from here)

CHILD_TIMEOUT_SECONDS = 1800  # one child trains a few steps of kiln-tiny; this only bounds a hung one
COMPARED = ("execution", "loaded", "seed", "configuration", "loss_history", "outcome", "checkpoints")
SFT_RECORDS = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                             {"role": "assistant", "content": f"{a + b}."}]}
               for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4)]]
GROUPS = [{"prompt": f"Q: {i} times 3 =", "completions": [
    {"text": f" {3 * i}.", "reward": 1.0}, {"text": f" {3 * i + 1}, I think", "reward": 0.0},
    {"text": " I cannot say", "reward": 0.2}]} for i in range(4)]
PROMPTS = ["Hello", "Tell me a story about", "What is 2 plus 2?"]
_MISSING = "<missing>"


class ChildFailed(Exception):
    """A child process ended without a receipt."""


def _routes(home: Path):
    """{route: (training kind, step to cancel after, request)}."""
    datasets = home / "datasets"
    stream = datasets / "groups.jsonl"
    stream.write_text("".join(json.dumps(g) + "\n" for g in GROUPS))
    teacher = {"alias": "qualifier@native", "route": "native", "base": "kiln-tiny", "adapter": None}
    teacher["identity_revision"] = teachers.identity_revision(teacher)
    common = {"seed": 3, "checkpoint_interval": 1, "lora": {"rank": 4, "alpha": 8}}
    return {
        "sft": ("sft", 3, {"data": SFT_RECORDS, "config": {
            **common, "output_name": "q-sft", "epochs": 2, "batch_size": 2, "learning_rate": 5e-3}}),
        "grpo_inline": ("grpo", 2, {"groups": GROUPS, "config": {
            **common, "output_name": "q-grpo", "epochs": 2, "groups_per_step": 2, "learning_rate": 2e-2,
            "beta": 0.05}}),
        "grpo_streamed": ("grpo", 2, {"dataset_path": str(stream), "config": {
            **common, "output_name": "q-stream", "epochs": 2, "groups_per_step": 1, "learning_rate": 2e-2,
            "streaming": True}}),
        "opd": ("opd", 2, {"prompts": PROMPTS, "config": {
            **common, "output_name": "q-opd", "teacher": teacher, "steps": 4, "max_new_tokens": 6,
            "learning_rate": 2e-2}}),
    }


def _home(path: Path) -> Path:
    (path / "datasets").mkdir(parents=True, exist_ok=True)
    (path / "adapters").mkdir(parents=True, exist_ok=True)
    return path


def _prepared(request, home: Path) -> dict:
    """The request with its dataset file copied (byte for byte) into this run's own data root."""
    req = json.loads(json.dumps(request))
    if "dataset_path" in req:
        source = Path(request["dataset_path"])
        (home / "datasets" / source.name).write_bytes(source.read_bytes())
        req["dataset_path"] = str(home / "datasets" / source.name)
    return req


def _child(spec: dict, work: Path) -> dict:
    """Run one qualification child in a fresh interpreter; its receipt."""
    stem = work / f"{spec['route']}-{spec['phase']}"
    spec_path, receipt_path = stem.with_suffix(".spec.json"), stem.with_suffix(".receipt.json")
    spec_path.write_text(json.dumps(spec))
    package_root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH"))
                                                       if p)}
    try:
        done = subprocess.run([sys.executable, "-m", "trainer.qualify_child", str(spec_path), str(receipt_path)],
                              env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        raise ChildFailed(f"no receipt within {CHILD_TIMEOUT_SECONDS} s") from None
    if done.returncode != 0 or not receipt_path.exists():
        lines = (done.stderr or "").strip().splitlines()
        raise ChildFailed(f"exit status {done.returncode}: {lines[-1] if lines else 'no output'}")
    return json.loads(receipt_path.read_text())


def _differences(path: str, expected, actual, out: list) -> None:
    """Dotted paths where ACTUAL differs from EXPECTED (JSON values; a float and an int never agree)."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key in list(expected) + [k for k in actual if k not in expected]:
            _differences(f"{path}.{key}", expected.get(key, _MISSING), actual.get(key, _MISSING), out)
    elif isinstance(expected, list) and isinstance(actual, list):
        for index in range(max(len(expected), len(actual))):
            _differences(f"{path}[{index}]", expected[index] if index < len(expected) else _MISSING,
                         actual[index] if index < len(actual) else _MISSING, out)
    elif type(expected) is not type(actual) or expected != actual:
        out.append(path)


def _first_per_field(paths: list) -> list:
    """The first differing path under each top-level field ("resumed.loss_history[2]", not every index)."""
    seen, out = set(), []
    for path in paths:
        head = ".".join(path.replace("[", ".[").split(".")[:2])
        if head not in seen:
            seen.add(head)
            out.append(path)
    return out


def _compare(receipts: dict, cancel_at: int) -> list:
    """Every mismatch between the four children's receipts, the first per field, the first run as the reference;
    causes (execution, what was loaded, seed, configuration) before effects (losses, bytes, checkpoints)."""
    first, repeat = receipts["first"], receipts["repeat"]
    cancelled, resumed = receipts["cancelled"], receipts["resumed"]
    found = []
    for key in COMPARED:
        _differences(f"repeat.{key}", first[key], repeat[key], found)
    for key in ("execution", "seed", "configuration"):
        _differences(f"cancelled.{key}", first[key], cancelled[key], found)
    _differences("cancelled.loaded", first["loaded"], cancelled["loaded"], found)
    if cancelled["status"] != "cancelled":
        found.append("cancelled.status")
    if cancelled["steps_completed"] != cancel_at:
        found.append("cancelled.steps_completed")
    _differences("cancelled.checkpoints", first["checkpoints"][:len(cancelled["checkpoints"])],
                 cancelled["checkpoints"], found)
    stopped = cancelled["checkpoints"][-1] if cancelled["checkpoints"] else {}
    resume = resumed["loaded"].get("resume") or {}
    if resume.get("checkpoint") != stopped.get("resume_checkpoint"):
        found.append("resumed.loaded.resume.checkpoint")
    if resume.get("checkpoint_id") != stopped.get("checkpoint_id"):
        found.append("resumed.loaded.resume.checkpoint_id")
    for key in COMPARED:
        if key == "checkpoints":
            _differences("resumed.checkpoints", first["checkpoints"],
                         cancelled["checkpoints"] + resumed["checkpoints"], found)
        elif key == "loaded":
            _differences("resumed.loaded", {**first["loaded"], "resume": None},
                         {**resumed["loaded"], "resume": None}, found)
        else:
            _differences(f"resumed.{key}", first[key], resumed[key], found)
    for label in ("repeat", "cancelled", "resumed"):
        if receipts[label]["process"]["pid"] in {receipts[other]["process"]["pid"] for other in receipts
                                                 if other != label} | {os.getpid()}:
            found.append(f"{label}.process.pid")
    return _first_per_field(found)


def _dataset(loaded: dict) -> dict:
    """The envelope's record of the exact dataset bytes a route trained on."""
    dataset = loaded["dataset"]
    count = next((dataset[k] for k in ("records", "groups", "prompts") if k in dataset), None)
    return {"sha256": dataset["sha256"], "bytes": dataset["bytes"], "records": count,
            "source": loaded["data_source"]}


def _qualify_route(name, kind, cancel_at, request, work: Path, bases_root: Path, backend: str) -> dict:
    started = time.perf_counter()
    receipts = {}

    def spec(label, req, home, stop=None):
        return {"route": name, "phase": label, "kind": kind, "home": str(home), "bases_root": str(bases_root),
                "backend": backend, "request": req, "cancel_at": stop}

    try:
        for label in ("first", "repeat"):
            home = _home(work / f"{name}-{label}")
            receipts[label] = _child(spec(label, _prepared(request, home), home), work)
        home = _home(work / f"{name}-resumed")
        req = _prepared(request, home)
        receipts["cancelled"] = _child(spec("cancelled", req, home, cancel_at), work)
        stopped = receipts["cancelled"]["checkpoints"]
        if receipts["cancelled"]["status"] != "cancelled" or not stopped:
            raise ChildFailed(f"the run did not stop with a checkpoint at step {cancel_at}")
        resumed = {**req, "config": {**req["config"], "resume_checkpoint": stopped[-1]["resume_checkpoint"]}}
        receipts["resumed"] = _child(spec("resumed", resumed, home), work)
    except ChildFailed as error:
        label = next(label for label in ("first", "repeat", "cancelled", "resumed") if label not in receipts)
        return {"route": name, "passed": False, "mismatches": [f"{label}.process"], "error": f"{label}: {error}",
                "cancelled_at": cancel_at, "seconds": round(time.perf_counter() - started, 3)}
    mismatches = _compare(receipts, cancel_at)
    first = receipts["first"]
    return {"route": name, "passed": not mismatches, "mismatches": mismatches,
            "first_mismatch": mismatches[0] if mismatches else None, "cancelled_at": cancel_at,
            "seconds": round(time.perf_counter() - started, 3), "outcome": first["outcome"],
            "dataset": _dataset(first["loaded"]), "configuration": first["configuration"], "seed": first["seed"],
            "processes": {label: r["process"]["pid"] for label, r in receipts.items()},
            "checkpoints": [c["checkpoint_id"] for c in first["checkpoints"]],
            "resumed_from": receipts["resumed"]["loaded"]["resume"], "execution": first["execution"]}


def selected_routes(table: dict, requested=None) -> list:
    """The routes to qualify: those asked for (all by default); a name that is not a route is a ValueError."""
    unknown = sorted(set(requested or ()) - set(table))
    if unknown:
        raise ValueError(f"unknown routes {unknown}; the routes are {', '.join(table)}")
    return [name for name in table if not requested or name in requested]


PRECISIONS = ("float32", "bfloat16", "tfloat32")


def with_precision(table: dict, precision: str) -> dict:
    """The routes' requests computing at PRECISION (float32: as they are, the config without the field)."""
    if precision == "float32":
        return table
    return {name: (kind, cancel_at, {**request, "config": {**request["config"], "precision": precision}})
            for name, (kind, cancel_at, request) in table.items()}


def qualify(backend="cpu", output=None, routes=None, progress=print, precision="float32") -> dict:
    """Run the qualification at PRECISION (each precision is its own envelope and receipt: the backend's `auto`
    computes a precision on cuda only where that precision was qualified); returns (and writes, when `output` is
    given) the receipt. A backend or precision that cannot run here (cuda without a usable device, bfloat16 on
    cpu without oneDNN's BF16 route, tfloat32 on cpu) raises BackendUnavailable or ValueError with the reason
    before anything runs, and no receipt is written: a receipt is evidence of runs, and none ran."""
    if backend not in ("cpu", "cuda"):
        raise ValueError(f"backend must be cpu or cuda, got {backend!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if backend == "cpu" and precision == "tfloat32":
        raise ValueError("precision tfloat32 is a CUDA tensor-core precision: qualify it with --backend cuda")
    if backend == "cpu" and precision == "bfloat16":
        from native_ext import onednn
        reason = onednn.unavailable_reason()
        if reason is not None:
            raise ValueError(f"precision bfloat16 cannot run on cpu here: {reason}")
    if backend == "cuda":
        require_cuda()
    from trainer.bases import load_base, show_base
    from trainer.runs.admission import execution_identity
    with tempfile.TemporaryDirectory(prefix="kiln-qualify-") as directory:
        work = Path(directory)
        bases_root = work / "bases-root"
        model, tokenizer = load_base("kiln-tiny", bases_root)
        model.close()
        results = []
        table = with_precision(_routes(_home(work / "shared")), precision)
        selected = selected_routes(table, routes)
        for name in selected:
            kind, cancel_at, request = table[name]
            progress(f"qualifying {name} (four fresh processes) ...")
            result = _qualify_route(name, kind, cancel_at, request, work, bases_root, backend)
            verdict = "passed" if result["passed"] else f"FAILED at {result['mismatches'][0]}" + (
                f" ({result['error']})" if result.get("error") else "")
            progress(f"  {name}: {verdict} ({result['seconds']:.1f} s)")
            results.append(result)
        base = show_base("kiln-tiny", bases_root)
        executions = [r["execution"] for r in results if "execution" in r]
        receipt = {
            "schema": RECEIPT_SCHEMA,
            "passed": bool(results) and all(r["passed"] for r in results),
            "backend": backend,
            "precision": precision,
            "failures": [f"{r['route']}: {r['mismatches'][0]}" for r in results if not r["passed"]],
            "envelope": {
                "model": {"name": "kiln-tiny", "identity": base.identity, "config": base.config},
                "execution": executions[0] if executions else execution_identity(backend, precision),
                "tokenizer": tokenizer.identity(),
                "data": {r["route"]: r["dataset"] for r in results if "dataset" in r},
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
