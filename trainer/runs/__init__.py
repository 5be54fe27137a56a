"""Run logic above the engine: the SFT, GRPO and OPD loops and their `.kiln-checkpoint` directories.

Each kind's module exports one `RUN_KIND` (trainer.runs.kind.RunKind); `run_kind(name)` looks it up.
Modules are imported on first use, so reading checkpoints does not import every run loop.
"""

import importlib
from types import ModuleType

from trainer.runs.kind import RunKind

RUN_KINDS = {"sft": "trainer.runs.sft", "grpo": "trainer.runs.grpo", "opd": "trainer.runs.opd"}


def run_kind(name: str, module: str | ModuleType | None = None) -> RunKind:
    """The RunKind of training kind NAME, from its module (RUN_KINDS[name] unless MODULE names another).

    A stand-in module without RUN_KIND (a test's fake runner) is read by the conventional names
    admit_<name>, revalidate_<name>, run_<name> and its admission class's from_json."""
    if name not in RUN_KINDS:
        raise LookupError(f"no training kind {name!r}; kinds are {', '.join(RUN_KINDS)}")
    if module is None or isinstance(module, str):
        module = importlib.import_module(module or RUN_KINDS[name])
    kind = getattr(module, "RUN_KIND", None)
    if kind is None:
        kind = _from_functions(name, module)
    if kind.name != name:
        raise LookupError(f"{module.__name__} runs {kind.name!r}, not {name!r}")
    return kind


def _from_functions(name: str, module: ModuleType) -> RunKind:
    functions = {role: getattr(module, f"{role}_{name}", None) for role in ("admit", "revalidate", "run")}
    admission = getattr(module, "SFTAdmission", None) or getattr(module, "Admission", None)
    missing = [f"{role}_{name}" for role, function in functions.items() if function is None]
    if missing or admission is None:
        raise LookupError(f"{module.__name__} has no RUN_KIND and lacks "
                          f"{', '.join(missing) or 'an Admission class'}")
    return RunKind(name=name, admission_from_json=admission.from_json,
                   manifest_fields=getattr(module, "MANIFEST_FIELDS", ()), **functions)
