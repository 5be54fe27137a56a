"""Semantic mutations of real `.kiln-checkpoint` state that keep every checksum valid: each one is refused.

Real small checkpoints of every kind (SFT, inline and streamed GRPO, OPD; tests/runs/state_runs.py) are made
once per session. Each case edits one thing in a checkpoint's state.json (or a progress field of its
manifest) and re-seals the checkpoint exactly as the publisher does (every size, SHA-256 and the
checkpoint_id recomputed), so only the semantic validation can notice. The mutations are the ones that
validation can always decide: a value of another JSON type anywhere (a string "NaN" for a loss, a boolean for
a step, null for a list), a list one element shorter or longer, an object with a key more or less, and a new
value wherever the manifest and the rest of the state determine it exactly (steps, cursors, counts, Adam
powers and hyperparameters, histories, flags, RNG and identity fields). Every case must be refused by the
full load with bad_field or inconsistent_state, leave the checkpoint's files byte for byte as written, and
restore nothing: a live resume of an edited checkpoint stops before the trainer is touched.
"""

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from trainer.runs import checkpoint_dir as cd
from trainer.runs.admission import MANIFEST_FIELDS

_spec = importlib.util.spec_from_file_location("state_runs", Path(__file__).parents[1] / "runs" / "state_runs.py")
state_runs = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("state_runs", state_runs)
_spec.loader.exec_module(state_runs)

CODES = {"bad_field", "inconsistent_state"}
KINDS = ("sft", "grpo_inline", "grpo_streamed", "opd")

# leaves whose value the validation cannot derive (it checks only their type and range): losses and the
# statistics a run measured, token counts the tokenizer gave, hashes of data it never sees, RNG positions
UNDETERMINED = [re.compile(p) for p in (
    r"loss_history/\d+$",  # (OPD's are decided: they equal metric_history[i].kl; see DETERMINED_FLOATS)
    r"diagnostics/\d+/grad_norm$",
    r"audit_history/\d+/(clip_\w+|kl_mean|ratio_\w+|reward_\w+|advantage_\w+)$",
    r"accumulators/(clipped_low|clipped_high|ratio_sum|kl_sum|reward_sum)$",
    r"plans/\d+/groups/\d+/(prompt_tokens|sha256|line_sha256|offset|length|line)$",
    r"plans/\d+/groups/\d+/completion_tokens/\d+$",
    r"pending/\d+/(sha256|line_sha256|offset|length|line)$",
    r"loop/chain$",
    r"candidates/\d+/tokens$",
    r"metric_history/\d+/(entropy|repetition_rate|grad_norm)$",
    r"guardrails/window/\d+/(entropy|repetition|kl)$",
    r"rng/rollout/state/state$",
    r"teacher/content_evidence/.*",
)]
DETERMINED_FLOATS = [re.compile(p) for p in (
    r"optimizer/(beta1_power|beta2_power)$", r"optimizer/hyperparameters/\w+$",
    r"metric_history/\d+/(kl|learning_rate)$", r"reference/mixup_alpha$", r"guardrails/config/\w+$",
)]


def _leaves(node, prefix=()):
    """(path, value) of every node of a JSON tree, containers included, the root excluded."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        path = prefix + (key,)
        yield path, value
        yield from _leaves(value, path)


def _text(path) -> str:
    return "/".join(map(str, path))


def _determined(path, value, kind) -> bool:
    text = _text(path)
    if isinstance(value, float):
        return any(p.search(text) for p in DETERMINED_FLOATS) or (kind == "opd" and text.startswith("loss_history/"))
    if kind == "opd" and text.startswith("loss_history/"):
        return True
    return not any(p.search(text) for p in UNDETERMINED)


def _other_types(value):
    """Values of every other JSON type (int and float count as different, as do bool and int)."""
    pool = [None, True, False, 0, 1, -1, 0.5, -2.0, "NaN", "0", "", [], [0], {}, {"x": 0}]
    if isinstance(value, bool):
        return [v for v in pool if not isinstance(v, bool)] + [int(value)]
    if isinstance(value, int):
        return [v for v in pool if not isinstance(v, int) or isinstance(v, bool)] + [float(value), bool(value % 2)]
    if isinstance(value, float):
        return [v for v in pool if not isinstance(v, float)] + ([int(value)] if value.is_integer() else [])
    return [v for v in pool if type(v) is not type(value)]


def _new_values(value):
    """Other values of the same type."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value - 1, value + 7, -value - 1, value * 2 + 1]
    if isinstance(value, float):
        return [value * 2 + 1.0, value + 1e-9, value * (1 - 1e-12) if value else 1e-300, -value - 0.25,
                value / 3 + 0.125]
    if isinstance(value, str):
        return [value + "x", value[:-1], "0" * 64 if value != "0" * 64 else "f" * 64]
    return []


@st.composite
def mutation(draw, documents):
    """(kind, checkpoint index, description, new state document or None, manifest change or None)."""
    name = draw(st.sampled_from(KINDS))
    index = draw(st.integers(0, len(documents[name]) - 1))
    state, manifest = documents[name][index]
    kind = manifest["checkpoint_type"]
    operation = draw(st.sampled_from(("type", "value", "value", "length", "keys", "progress", "whole")))
    state = json.loads(json.dumps(state))
    if operation == "whole":
        return name, index, "whole document", draw(st.sampled_from([[], {}, None, 0, "state", [state]])), None
    if operation == "progress":
        cursor = manifest["progress"]["next_cursor"]
        key = draw(st.sampled_from(sorted(k for k in cursor if k not in ("prompt_sha256", "consumed_lines_sha256",
                                                                         "group_sha256") or cursor[k] is None)
                                   + ["total_steps", "complete"]))

        def change(m, key=key):
            where = m["progress"] if key in ("total_steps", "complete") else m["progress"]["next_cursor"]
            old = where[key]
            where[key] = (not old) if isinstance(old, bool) else "0" * 64 if old is None else old + 1
        return name, index, f"progress {key}", None, change
    nodes = list(_leaves(state))
    if operation == "length":
        lists = [(p, v) for p, v in nodes if isinstance(v, list) and not _text(p).startswith("teacher/")]
        path, value = draw(st.sampled_from(lists))
        choice = draw(st.sampled_from(("drop last", "drop first", "repeat last", "append 0")))
        if not value and choice != "append 0":
            choice = "append 0"
        new = {"drop last": value[:-1], "drop first": value[1:], "repeat last": value + value[-1:],
               "append 0": value + [0]}[choice]
        operation = f"length {choice}"
    elif operation == "keys":
        objects = [(p, v) for p, v in nodes if isinstance(v, dict) and not _text(p).startswith("teacher/")]
        objects.append(((), state))
        path, value = draw(st.sampled_from(objects))
        if value and draw(st.booleans()):
            gone = draw(st.sampled_from(sorted(value)))
            new = {k: v for k, v in value.items() if k != gone}
            operation = f"key {gone} removed"
        else:
            new = {**value, "unexpected": 0}
            operation = "key added"
        if path == ():
            return name, index, operation, new, None
    else:
        if operation == "type":
            candidates = nodes
        else:
            candidates = [(p, v) for p, v in nodes if not isinstance(v, (list, dict)) and v is not None
                          and _determined(p, v, kind)]
        path, value = draw(st.sampled_from(candidates))
        pool = _other_types(value) if operation == "type" else _new_values(value)
        new = draw(st.sampled_from(pool))
        operation = f"{operation} {value!r:.40} -> {new!r:.40}"
    node = state
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = new
    return name, index, f"{_text(path)}: {operation}", state, None


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """{name: [(checkpoint path, state bytes, manifest bytes)]} of every checkpoint of the four runs, and the
    work copies each case edits and restores: {name: [copy path]}."""
    root = tmp_path_factory.mktemp("semantic-runs")
    runs = state_runs.make_runs(root)
    work = root / "work"
    originals, copies = {}, {}
    for name, (_, _, paths) in runs.items():
        originals[name], copies[name] = [], []
        for index, path in enumerate(paths):
            registry = work / f"{name}-{index}"
            registry.mkdir(parents=True)
            shutil.copytree(path, registry / path.name)
            originals[name].append(((path / "state.json").read_bytes(), (path / cd.MANIFEST).read_bytes()))
            copies[name].append(registry / path.name)
    return runs, originals, copies


def _documents(originals):
    return {name: [(json.loads(state), json.loads(manifest)) for state, manifest in entries]
            for name, entries in originals.items()}


def test_unedited_real_checkpoints_load(real):
    runs, originals, copies = real
    for name, paths in copies.items():
        assert len(paths) >= 4, name
        for path in paths:
            assert cd.load_checkpoint(path, allowed_manifest_fields=MANIFEST_FIELDS).step >= 1


def test_semantic_mutations_are_refused(real, fuzz):
    runs, originals, copies = real
    documents = _documents(originals)

    @fuzz.settings(2200)
    @given(case=mutation(documents))
    def run(case):
        name, index, what, state, change_manifest = case
        path = copies[name][index]
        original_state, original_manifest = originals[name][index]
        manifest = json.loads(original_manifest)
        if change_manifest is not None:
            change_manifest(manifest)
        raw = original_state if state is None and change_manifest is not None else \
            json.dumps(state, sort_keys=True, separators=(",", ":")).encode()
        assume(raw != original_state or manifest != json.loads(original_manifest))
        try:
            state_runs.rewrite(path, manifest=manifest, state_raw=raw)
            written = {p.name: p.read_bytes() for p in sorted(path.iterdir())}
            with fuzz.case("kiln", "state semantics"):
                with pytest.raises(cd.CheckpointError) as info:
                    cd.load_checkpoint(path, allowed_manifest_fields=MANIFEST_FIELDS)
                error = info.value
                assert error.code in CODES, f"{name} #{index} {what}: refused as {error.code}: {error}"
                assert getattr(error, "field", None), f"{name} #{index} {what}: no field named: {error}"
                assert {p.name: p.read_bytes() for p in sorted(path.iterdir())} == written
        finally:
            (path / "state.json").write_bytes(original_state)
            (path / cd.MANIFEST).write_bytes(original_manifest)

    run()
    fuzz.floor("kiln", "state semantics", 2000)


class Restored(Exception):
    pass


@pytest.mark.parametrize("name", KINDS)
def test_a_live_resume_of_an_edited_checkpoint_restores_nothing(real, name, monkeypatch, tmp_path):
    """Admitted against the unedited checkpoint, then edited (re-sealed) before the run: the worker's reload
    refuses it before the model's adapter or the optimizer is restored."""
    import copy
    import dataclasses

    from trainer.runs import run_kind, state
    runs, originals, _ = real
    settings, request, paths = runs[name]
    source = paths[len(paths) // 2]
    registry = tmp_path / "registry"
    registry.mkdir()
    target = registry / source.name
    shutil.copytree(source, target)
    settings = dataclasses.replace(settings, registry=registry)
    request_kind = {"sft": "sft", "opd": "opd"}.get(name, "grpo")
    kind = run_kind(request_kind)
    request = copy.deepcopy(request)
    request["config"]["resume_checkpoint"] = source.name
    admission = kind.admit(request, settings)
    document = json.loads((target / "state.json").read_bytes())
    document["optimizer"]["step"] += 1
    state_runs.rewrite(target, state=document)
    admission.resume["checkpoint_id"] = json.loads((target / cd.MANIFEST).read_bytes())["checkpoint_id"]
    written = {p.name: p.read_bytes() for p in sorted(target.iterdir())}

    def restored(*args, **kwargs):
        raise Restored("restore_optimizer ran on an edited checkpoint")

    monkeypatch.setattr(state, "restore_optimizer", restored)
    monkeypatch.setattr(sys.modules[f"trainer.runs.{request_kind}"], "restore_optimizer", restored)
    with pytest.raises(Exception) as info:
        kind.run(admission, settings)
    assert not isinstance(info.value, Restored)
    assert getattr(info.value, "code", None) == "inconsistent_state", repr(info.value)
    assert {p.name: p.read_bytes() for p in sorted(target.iterdir())} == written
