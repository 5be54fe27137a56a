"""Semantic validation of `.kiln-checkpoint` state: an edited state.json whose manifest sizes, SHA-256s and
checkpoint_id were recomputed (exactly as the publisher does, by tests/runs/state_runs.py's own code) is refused
by the strict loader, by `kiln checkpoint verify` (exit 1, with the reason) and by resume admission, for every
kind (SFT, inline and streamed GRPO, OPD). Unedited checkpoints of real runs pass all three."""

import copy
import dataclasses
import json
import shutil

import pytest

from state_runs import make_runs, rewrite
from trainer.runs import checkpoint_dir
from trainer.runs.admission import MANIFEST_FIELDS, AdmissionError

CODES = {"inconsistent_state", "bad_field"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return make_runs(tmp_path_factory.mktemp("state-runs"))


def pick(runs, name, which):
    """A checkpoint of run NAME: 'first', 'middle', 'last' or 'pending' (GRPO mid-batch)."""
    settings, request, paths = runs[name]
    if which == "first":
        return paths[0]
    if which == "last":
        return paths[-1]
    if which == "pending":
        return next(p for p in paths if (p / "rollout.safetensors").exists())
    return paths[len(paths) // 2]


def edited_copy(path, tmp_path, change_state=None, change_manifest=None, raw=None):
    """A copy of checkpoint PATH in a fresh registry, edited and re-sealed (sizes, SHA-256s, checkpoint_id)."""
    registry = tmp_path / "registry"
    registry.mkdir(parents=True, exist_ok=True)
    target = registry / path.name
    shutil.copytree(path, target)
    state = json.loads((target / "state.json").read_bytes())
    manifest = json.loads((target / checkpoint_dir.MANIFEST).read_bytes())
    if change_state is not None:
        replaced = change_state(state, manifest)
        state = state if replaced is None else replaced
    if change_manifest is not None:
        change_manifest(manifest)
    rewrite(target, state=None if raw is not None else state, manifest=manifest, state_raw=raw)
    return target


def load(path):
    return checkpoint_dir.load_checkpoint(path, allowed_manifest_fields=MANIFEST_FIELDS)


def verify(path, capsys):
    from kiln_web.cli import main
    code = main(["checkpoint", "verify", str(path)])
    return code, capsys.readouterr()


def admit(runs, name, path):
    """Resume admission of the (edited) checkpoint at PATH with the run's own request."""
    settings, request, _ = runs[name]
    module_kind = {"sft": "sft", "grpo_inline": "grpo", "grpo_streamed": "grpo", "opd": "opd"}[name]
    from trainer.runs import run_kind
    kind = run_kind(module_kind)
    request = copy.deepcopy(request)
    request["config"]["resume_checkpoint"] = path.name
    return kind.admit(request, dataclasses.replace(settings, registry=path.parent))


def refused(runs, name, path, capsys, tmp_path=None):
    """Loader, CLI and admission all refuse PATH with the same code; returns (code, message)."""
    with pytest.raises(checkpoint_dir.CheckpointError) as info:
        load(path)
    error = info.value
    assert error.code in CODES, f"{error.code}: {error}"
    assert getattr(error, "field", None), f"no field named (the validator's safety net caught a bug): {error}"
    code, out = verify(path, capsys)
    assert code == 1 and f"invalid: {path.name}: {error.code}: " in out.err, out
    with pytest.raises(AdmissionError) as admission:
        admit(runs, name, path)
    assert admission.value.code == error.code, str(admission.value)
    return error.code, str(error)


def test_real_checkpoints_pass_loader_cli_and_admission(runs, capsys, tmp_path):
    count = 0
    for name, (settings, request, paths) in runs.items():
        assert len(paths) >= 4
        for path in paths:
            loaded = load(path)
            assert loaded.step == int(path.name.split("-step-")[1].split(".")[0])
            count += 1
        code, out = verify(paths[-2], capsys)
        assert code == 0 and out.out.startswith(f"valid: {paths[-2].name}"), out
        assert "not its state" not in out.out  # a real run's checkpoint: its state was checked too
        with pytest.raises(AdmissionError) as behind:  # the run's last checkpoint lies beside it
            admit(runs, name, paths[-2])
        assert behind.value.code == "later_checkpoints" and paths[-1].name in str(behind.value)
        alone = shutil.copytree(paths[-2], tmp_path / name / paths[-2].name)  # alone in a registry of its own
        admission = admit(runs, name, alone)
        assert admission.resume["checkpoint"] == paths[-2].name
    assert count == sum(len(paths) for _, _, paths in runs.values())


# -- the fourteen measured holes, for every kind -------------------------------------------------------------


def _cursor_beyond(state, manifest):
    kind = manifest["checkpoint_type"]
    if kind == "sft":
        state["loop"]["position"] = manifest["dataset"]["records"] + 1
    elif kind == "grpo":
        state["loop"]["group"] = manifest["dataset"]["groups"] + 1
    else:
        state["loop"]["candidate"] += 10 * manifest["dataset"]["prompts"]


def _epoch_beyond(state, manifest):
    kind = manifest["checkpoint_type"]
    if kind == "opd":  # OPD has no epochs: its candidate cursor runs past the candidates consumed
        state["loop"]["candidate"] += 1
    else:
        state["loop"]["epoch"] = manifest["config"]["epochs"] + 1


def _history_short(state, manifest):
    key = {"sft": "diagnostics", "grpo": "audit_history", "opd": "metric_history"}[manifest["checkpoint_type"]]
    state[key] = state[key][:-1]


def _set(path, value):
    def change(state, manifest):
        node = state
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value(node[path[-1]]) if callable(value) else value
    return change


HOLES = {
    "loop.step one ahead": _set(("loop", "step"), lambda v: v + 1),
    "optimizer.step one behind": _set(("optimizer", "step"), lambda v: v - 1),
    "beta1_power no step gives": _set(("optimizer", "beta1_power"), lambda v: v * 0.95),
    "scheduler.step disagrees": _set(("scheduler", "step"), lambda v: v + 1),
    "loss_history one short": _set(("loss_history",), lambda v: v[:-1]),
    "loss_history one long": _set(("loss_history",), lambda v: v + [v[-1]]),
    "cursor beyond the data": _cursor_beyond,
    "epoch beyond epochs": _epoch_beyond,
    "Adam beta1 changed": _set(("optimizer", "hyperparameters", "beta1"), 0.95),
    "Adam epsilon changed": _set(("optimizer", "hyperparameters", "epsilon"), 1e-6),
    "Adam weight_decay changed": _set(("optimizer", "hyperparameters", "weight_decay"), 0.01),
    "Adam learning_rate changed": _set(("optimizer", "hyperparameters", "learning_rate"), lambda v: v * 2),
    "loss is the string NaN": _set(("loss_history",), lambda v: v[:-1] + ["NaN"]),
    "negative loop.step": _set(("loop", "step"), -1),
    "negative optimizer.step": _set(("optimizer", "step"), -3),
    "diagnostics one short": _history_short,
    "state.json holds []": lambda state, manifest: [],
    "state.json holds {}": lambda state, manifest: {},
    "beta2_power one step behind": _set(("optimizer", "beta2_power"), lambda v: v / 0.999),
    "unknown state field": _set(("extra",), 1),
    "scheduler missing": lambda state, manifest: {k: v for k, v in state.items() if k != "scheduler"},
    "optimizer.step a float": _set(("optimizer", "step"), lambda v: float(v)),
    "loss_history a string": _set(("loss_history",), "[]"),
    "loss is null": _set(("loss_history",), lambda v: [None] + v[1:]),
}
KINDS = ("sft", "grpo_inline", "grpo_streamed", "opd")


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("hole", sorted(HOLES))
def test_consistently_resealed_state_edit_is_refused(runs, name, hole, tmp_path, capsys):
    path = edited_copy(pick(runs, name, "middle"), tmp_path, HOLES[hole])
    code, message = refused(runs, name, path, capsys)
    assert "state" in message or "manifest" in message, message


@pytest.mark.parametrize("name", KINDS)
def test_bool_as_int_is_refused(runs, name, tmp_path, capsys):
    """At step 1, true == 1 in Python: a boolean step must still be refused."""
    path = edited_copy(pick(runs, name, "first"), tmp_path, _set(("loop", "step"), True))
    assert refused(runs, name, path, capsys)[0] == "bad_field"
    path = edited_copy(pick(runs, name, "first"), tmp_path / "b", _set(("scheduler", "step"), True))
    assert refused(runs, name, path, capsys)[0] == "bad_field"


RAW = {
    "not JSON": b"{",
    "NaN literal": None,  # filled per checkpoint: a loss written as NaN
    "Infinity literal": None,
    "not canonical": None,  # the same document with spaces
    "duplicate key": None,
    "not ASCII": None,
}


def _raw(kind, state_bytes):
    text = state_bytes.decode()
    if kind == "not JSON":
        return b"{"
    if kind == "NaN literal":
        return text.replace('"loss_history":[', '"loss_history":[NaN,', 1).encode()
    if kind == "Infinity literal":
        return text.replace('"loss_history":[', '"loss_history":[Infinity,', 1).encode()
    if kind == "not canonical":
        return json.dumps(json.loads(text), sort_keys=True).encode()
    if kind == "duplicate key":
        return text.replace('"scheduler":{"step":', '"scheduler":{"step":0,"step":', 1).encode()
    return text.replace('"loop":{', '"loop":{"\u00e9":0,', 1).encode("utf-8")


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("kind", sorted(RAW))
def test_malformed_state_bytes_are_refused(runs, name, kind, tmp_path, capsys):
    source = pick(runs, name, "middle")
    path = edited_copy(source, tmp_path, raw=_raw(kind, (source / "state.json").read_bytes()))
    assert refused(runs, name, path, capsys)[0] == "bad_field"


# -- kind-specific rules ------------------------------------------------------------------------------------


def _first_diag(key, value):
    def change(state, manifest):
        state["diagnostics"][0][key] = value(state["diagnostics"][0][key])
    return change


def _manifest(change):
    return lambda manifest: change(manifest)


SPECIFIC = [
    ("sft", "middle", _first_diag("clipped", lambda v: not v), None),
    ("sft", "middle", _first_diag("loss_spike", lambda v: not v), None),
    ("sft", "middle", _first_diag("grad_norm", lambda v: -v), None),
    ("sft", "middle", _set(("loop", "position"), lambda v: v - 1), None),
    ("sft", "middle", None, lambda m: m["progress"]["next_cursor"].update(example=m["progress"]["next_cursor"]
                                                                          ["example"] + 1)),
    ("sft", "middle", None, lambda m: m["progress"].update(total_steps=m["progress"]["total_steps"] + 1)),
    ("sft", "last", None, lambda m: m["progress"].update(complete=False)),
    ("sft", "middle", None, lambda m: m["config"].update(batch_size=m["config"]["batch_size"] + 1)),
    ("grpo_inline", "pending", _set(("pending",), None), None),
    ("grpo_inline", "middle", _set(("reference", "refreshes"), lambda v: v + [99]), None),
    ("grpo_inline", "middle", _set(("accumulators", "tokens"), lambda v: v + 1), None),
    ("grpo_inline", "middle", _set(("accumulators", "steps"), lambda v: v - 1), None),
    ("grpo_inline", "middle", _set(("rng", "lora_init", "seed"), lambda v: v + 1), None),
    ("grpo_inline", "middle", _set(("loop", "iteration"), lambda v: 1 - v), None),
    ("grpo_inline", "middle", lambda s, m: s["plans"][0]["groups"][0].update(index=4), None),
    ("grpo_inline", "middle", lambda s, m: s["audit_history"][0].update(tokens=s["audit_history"][0]["tokens"] + 1),
     None),
    ("grpo_inline", "middle", None, lambda m: m["progress"]["reference"].update(refreshes=7)),
    ("grpo_inline", "last", None, lambda m: m["progress"]["next_cursor"].update(group_sha256="0" * 64)),
    ("grpo_streamed", "middle", _set(("loop", "byte"), lambda v: v + 1), None),
    ("grpo_streamed", "middle", _set(("loop", "chain_lines"), lambda v: v + 1), None),
    ("grpo_streamed", "middle", lambda s, m: s["plans"][-1]["groups"][-1].update(line=0), None),
    ("grpo_streamed", "middle", None, lambda m: m["progress"]["next_cursor"].update(byte=0)),
    ("opd", "middle", _set(("loop", "idle"), 1), None),
    ("opd", "middle", _set(("rng", "rollout", "state", "inc"), lambda v: v + 2), None),
    ("opd", "middle", _set(("rng", "rollout", "has_uint32"), 1), None),
    ("opd", "middle", lambda s, m: s["candidates"][0].update(update_step=2), None),
    ("opd", "middle", lambda s, m: s["candidates"][0].update(prompt=1), None),
    ("opd", "middle", lambda s, m: s["metric_history"][0].update(kl=1.5), None),
    ("opd", "middle", lambda s, m: s["metric_history"][0].update(candidates_consumed=0), None),
    ("opd", "middle", lambda s, m: s["guardrails"]["window"].pop(), None),
    ("opd", "middle", lambda s, m: s["guardrails"]["config"].update(window=4), None),
    ("opd", "middle", lambda s, m: s["teacher"].update(content_revision="0" * 64), None),
    ("opd", "middle", None, lambda m: m["progress"]["next_cursor"].update(prompt=0, candidate=0, epoch=0)),
]


@pytest.mark.parametrize("case", range(len(SPECIFIC)))
def test_kind_specific_edit_is_refused(runs, case, tmp_path, capsys):
    name, which, change_state, change_manifest = SPECIFIC[case]
    path = edited_copy(pick(runs, name, which), tmp_path, change_state, change_manifest)
    refused(runs, name, path, capsys)


def test_refusal_is_a_400_through_the_api_mapping(runs, tmp_path):
    from kiln_web.jobs.runtime import refusal_for
    path = edited_copy(pick(runs, "sft", "middle"), tmp_path, HOLES["loop.step one ahead"])
    with pytest.raises(AdmissionError) as info:
        admit(runs, "sft", path)
    refusal = refusal_for(info.value, "sft")
    assert (refusal.status, refusal.code) == (400, "inconsistent_state")
    assert "state.loop.step" in refusal.message


def test_refusal_leaves_the_files_unchanged(runs, tmp_path):
    path = edited_copy(pick(runs, "opd", "middle"), tmp_path, HOLES["loss is the string NaN"])
    before = {p.name: p.read_bytes() for p in sorted(path.iterdir())}
    with pytest.raises(checkpoint_dir.CheckpointError):
        load(path)
    assert {p.name: p.read_bytes() for p in sorted(path.iterdir())} == before


def test_older_planning_schema_is_inspectable_and_refused_by_admission_for_it(runs, tmp_path, capsys):
    """A checkpoint planned under another schema is not held to the current writer's state rules (the contract:
    inspectable and checksum-valid), and admission refuses it for its planning schema, not its state."""
    def older(manifest):
        manifest["planning"]["schema"] = "kiln.training-checkpoint-planning.v2"

    path = edited_copy(pick(runs, "grpo_inline", "middle"), tmp_path, HOLES["loop.step one ahead"], older)
    assert load(path).step == int(path.name.split("-step-")[1].split(".")[0])
    assert verify(path, capsys)[0] == 0
    with pytest.raises(AdmissionError) as info:
        admit(runs, "grpo_inline", path)
    assert info.value.code == "planning_schema"


@pytest.mark.parametrize("name", KINDS)
def test_dequeue_revalidation_refuses_a_state_edited_after_admission(runs, name, tmp_path):
    from trainer.runs import run_kind
    source = pick(runs, name, "middle")
    path = edited_copy(source, tmp_path)  # unedited: admitted
    admission = admit(runs, name, path)
    settings = dataclasses.replace(runs[name][0], registry=path.parent)
    kind = run_kind(admission.kind)
    kind.revalidate(admission, settings)
    document = json.loads((path / "state.json").read_bytes())
    document["scheduler"]["step"] += 1
    rewrite(path, state=document)
    with pytest.raises(AdmissionError) as info:
        kind.revalidate(admission, settings)
    assert info.value.code == "inconsistent_state" and "state.scheduler.step" in str(info.value)
