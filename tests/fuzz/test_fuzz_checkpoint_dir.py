"""Hostile `.kiln-checkpoint` directories: every mutation of a published one is refused with its code.

A real checkpoint (publish_checkpoint with five files, one nested and one empty) is copied
and mutated: flipped bytes, truncated and extended files, extra, missing and renamed files
and directories, symlinks (to files inside and outside, to directories, dangling), hard
links, FIFOs, an oversized manifest, and manifests with hostile paths, unknown fields, wrong
types, huge numbers, duplicate keys, NaN and deep nesting. Each case must raise the
CheckpointError subclass whose `code` the mutation kind implies, for a full load and for a
light (status) load, within CASE_SECONDS.
"""

import json
import os
import random
import shutil
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from trainer.jsonio import canonical_bytes
from trainer.runs import checkpoint_dir as cd

ADAPTER, STEP = "bot", 3
NAME = cd.checkpoint_basename(ADAPTER, STEP)
_rng = random.Random(3)
FILES = {  # distinct sizes, so two swapped files always differ in size
    "adapter.safetensors": _rng.randbytes(4096),
    "optimizer.safetensors": _rng.randbytes(6000),
    "rng/streams.json": b'{"python": 7}',
    "state.json": b'{"step": 3, "cursor": 6}',
    "empty.bin": b"",
}
FIELDS = {"seed": 1234, "config": {"epochs": 3, "learning_rate": 1e-4},
          "progress": {"committed_step": STEP, "total_steps": 100, "complete": False,
                       "next_cursor": {"epoch": 0, "example": 6}},
          "loss_history": [1.0, 0.5, 0.25]}
NONEMPTY = sorted(name for name, data in FILES.items() if data)
SENTINEL = "kiln-fuzz-sentinel"

# what a damaged manifest may be refused as: which check notices depends on the bytes hit
MANIFEST_DAMAGE = {"bad_field", "checksum_mismatch", "unsupported_schema", "unsupported_type",
                   "unknown_field", "bad_path"}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    registry = tmp_path_factory.mktemp("pristine")
    return cd.publish_checkpoint(registry, ADAPTER, STEP, checkpoint_type="sft", files=FILES,
                                 manifest=FIELDS)


@pytest.fixture(scope="module")
def room(tmp_path_factory):
    """(registry, outside): emptied before every case."""
    base = tmp_path_factory.mktemp("cases")
    return base / "registry", base / "outside"


def fresh_copy(pristine, room) -> Path:
    registry, outside = room
    for folder in (registry, outside):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
    target = registry / NAME
    shutil.copytree(pristine, target)
    return target


def load(path, full):
    return cd.load_checkpoint(path, full=full, expected_type="sft", expected_adapter=ADAPTER,
                              allowed_manifest_fields=set(FIELDS))


def refused_code(path, full) -> str | None:
    """The refusal's code, or None when the checkpoint loads; any other exception fails."""
    try:
        load(path, full)
    except cd.CheckpointError as error:
        assert isinstance(error, cd.ERRORS[error.code]), error
        return error.code
    return None


def rewrite(path, change, recompute=True):
    """Apply change(manifest) and write it canonically; recompute: the id of the new content."""
    manifest = json.loads((path / cd.MANIFEST).read_bytes())
    change(manifest)
    if recompute:
        manifest["checkpoint_id"] = cd.content_id(manifest)
    (path / cd.MANIFEST).write_bytes(canonical_bytes(manifest) + b"\n")


def put(tree, keys, value):
    node = tree
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value


def control_loads(path):
    loaded = load(path, full=True)
    assert loaded.files == FILES and load(path, full=False).files == {}


def test_unmutated_copies_load(pristine, room):
    control_loads(fresh_copy(pristine, room))


# -- mutations of the files ----------------------------------------------------------------------
# each strategy gives (kind, apply(path, outside) -> path, full-load codes, light-load codes);
# light codes None: a status load does not hash, so it accepts content-only damage


def flip_file():
    return st.builds(
        lambda rel, fraction, mask: (
            "flipped file byte", lambda p, o: _flip(p / rel, fraction, mask), {"checksum_mismatch"},
            None),
        st.sampled_from(NONEMPTY), st.floats(0, 1, exclude_max=True), st.integers(1, 255))


def _flip(file: Path, fraction, mask):
    data = bytearray(file.read_bytes())
    data[int(len(data) * fraction)] ^= mask
    file.write_bytes(bytes(data))


def flip_manifest():
    return st.builds(
        lambda fraction, masks: (
            "flipped manifest bytes", lambda p, o: _flips(p / cd.MANIFEST, fraction, masks),
            MANIFEST_DAMAGE, MANIFEST_DAMAGE),
        st.floats(0, 1, exclude_max=True), st.lists(st.integers(1, 255), min_size=1, max_size=3))


def _flips(file: Path, fraction, masks):
    original = file.read_bytes()
    data = bytearray(original)
    start = int(len(data) * fraction)
    for i, mask in enumerate(masks):
        data[min(start + i, len(data) - 1)] ^= mask
    # at the last byte the masks land on one byte and can cancel out (5 then 5): that is no damage at all
    assume(bytes(data) != original)
    file.write_bytes(bytes(data))


def resize_file():
    return st.builds(
        lambda rel, delta: (
            "truncated file" if delta < 0 else "extended file",
            lambda p, o: _resize(p / rel, delta), {"size_mismatch"}, {"size_mismatch"}),
        st.sampled_from(sorted(FILES)), st.integers(-64, 64).filter(lambda d: d != 0))


def _resize(file: Path, delta):
    data = file.read_bytes()
    file.write_bytes(data[:max(0, len(data) + delta)] if delta < 0 else data + b"\0" * delta)
    if len(data) + delta < 0:  # an empty file cannot shrink: grow it instead
        file.write_bytes(b"x")


def resize_manifest():
    return st.builds(
        lambda keep, tail: (
            "truncated/extended manifest", lambda p, o: _cut(p / cd.MANIFEST, keep, tail),
            {"bad_field"}, {"bad_field"}),
        st.floats(0, 1, exclude_max=True), st.binary(max_size=32))


def _cut(file: Path, keep, tail):
    data = file.read_bytes()
    cut = data[:int(len(data) * keep)] + tail if tail else data[:int(len(data) * keep)]
    if cut == data:
        cut = data + b" "
    file.write_bytes(cut)


EXTRA_NAMES = st.sampled_from(["notes.txt", ".hidden", "rng/extra.json", "new/deep/file.bin",
                               "adapter.safetensors.bak", "State.json", "rng/.x", " ", "a b",
                               "checkpoint_manifest.json.tmp", "rng/checkpoint_manifest.json",
                               "adapter_config.json", "\u00e9t\u00e9.bin", "x" * 255])


def extra_file():
    return st.builds(
        lambda rel, data: ("extra file", lambda p, o: _write(p / rel, data), {"extra_file"},
                           {"extra_file"}),
        EXTRA_NAMES | st.text(st.characters(codec="utf-8", exclude_characters="/\x00"),
                              min_size=1, max_size=30).filter(
                                  lambda n: n not in (".", "..", cd.MANIFEST, cd.SENTINEL)
                                  and n not in FILES and n != "rng"),
        st.binary(max_size=64))


def _write(file: Path, data):
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_bytes(data)


def extra_directory():
    return st.builds(
        lambda rel: ("extra directory", lambda p, o: (p / rel).mkdir(parents=True),
                     {"extra_file"}, {"extra_file"}),
        st.sampled_from(["empty", ".git", "rng/sub", "a/b/c", "state.json.d"]))


def sentinel():
    return st.builds(
        lambda kind: ("sentinel", lambda p, o: _special(p / cd.SENTINEL, kind, o),
                      {"incomplete"}, {"incomplete"}),
        st.sampled_from(["file", "directory", "fifo", "symlink"]))


def missing():
    return st.builds(
        lambda rel: ("missing file", lambda p, o: (p / rel).unlink(),
                     {"missing_manifest" if rel == cd.MANIFEST else "missing_file"},
                     {"missing_manifest" if rel == cd.MANIFEST else "missing_file"}),
        st.sampled_from(sorted(FILES) + [cd.MANIFEST]))


def missing_directory():
    return st.just(("missing directory", lambda p, o: shutil.rmtree(p / "rng"), {"missing_file"},
                    {"missing_file"}))


def renamed():
    return st.builds(
        lambda rel, new: ("renamed file", lambda p, o: os.rename(p / rel, p / new),
                          {"missing_manifest" if rel == cd.MANIFEST else "missing_file"},
                          {"missing_manifest" if rel == cd.MANIFEST else "missing_file"}),
        st.sampled_from(sorted(FILES) + [cd.MANIFEST]),
        st.sampled_from(["renamed.bin", "Adapter.safetensors", "rng/moved.json", ".hidden"]))


def swapped():
    return st.builds(
        lambda pair: ("swapped files", lambda p, o: _swap(p / pair[0], p / pair[1]),
                      {"size_mismatch"}, {"size_mismatch"}),
        st.lists(st.sampled_from(sorted(FILES)), min_size=2, max_size=2, unique=True))


def _swap(a: Path, b: Path):
    temporary = a.with_name("swap.tmp")
    os.rename(a, temporary)
    os.rename(b, a)
    os.rename(temporary, b)


def renamed_directory():
    names = ["renamed", NAME + ".bak", cd.checkpoint_basename(ADAPTER, 4),
             cd.checkpoint_basename("other", STEP), "." + NAME + ".staging-0123456789abcdef",
             "bot-checkpoint-step-3.kiln-checkpoint"]
    return st.builds(
        lambda new: ("renamed checkpoint", lambda p, o: p.rename(p.with_name(new)),
                     {"noncanonical_name", "inconsistent_state"},
                     {"noncanonical_name", "inconsistent_state"}),
        st.sampled_from(names))


LINK_TARGETS = ("inside file", "outside file", "inside directory", "outside directory",
                "dangling", "self")


def symlinked():
    def apply(p, o, rel, target):
        at, destination = p / rel, _link_target(p, o, rel, target)
        if at.is_dir():
            shutil.rmtree(at)
        elif at.exists():
            at.unlink()
        os.symlink(destination, at)
        return p
    return st.builds(
        lambda rel, target: ("symlink", lambda p, o: apply(p, o, rel, target), {"symlink"},
                             {"symlink"}),
        st.sampled_from(sorted(FILES) + [cd.MANIFEST, "rng", "extra-link"]),
        st.sampled_from(LINK_TARGETS))


def _link_target(p, o, rel, target):
    if target == "inside file":
        return p / "state.json"
    if target == "inside directory":
        return p / "rng"
    if target == "outside file":
        source = FILES.get(rel, b"outside")
        (o / "copy").write_bytes(source)
        return o / "copy"
    if target == "outside directory":
        shutil.copytree(p / "rng", o / "rng", dirs_exist_ok=True)
        return o / "rng"
    if target == "self":
        return p / rel
    return o / "missing"


def symlinked_checkpoint():
    def apply(p, o):
        real = o / "real"
        shutil.copytree(p, real)
        shutil.rmtree(p)
        os.symlink(real, p)
        return p
    return st.just(("symlinked checkpoint", apply, {"symlink"}, {"symlink"}))


def hard_linked():
    def apply(p, o, rel, where):
        link = o / "link" if where == "outside" else p / "extra-hard-link"
        os.link(p / rel, link)
        return p
    return st.builds(
        lambda rel, where: ("hard link", lambda p, o: apply(p, o, rel, where), {"hard_link"},
                            {"hard_link"}),
        st.sampled_from(sorted(FILES) + [cd.MANIFEST]), st.sampled_from(["outside", "inside"]))


def special_files():
    def code(rel, kind):  # an undeclared empty directory is an extra entry, not a special file
        return "extra_file" if (rel, kind) == ("extra-fifo", "directory") else "untracked_file"
    return st.builds(
        lambda rel, kind: ("FIFO or directory", lambda p, o: _special(p / rel, kind, o),
                           {code(rel, kind)}, {code(rel, kind)}),
        st.sampled_from(sorted(FILES) + [cd.MANIFEST, "extra-fifo"]),
        st.sampled_from(["fifo", "directory"]))


def _special(at: Path, kind, outside):
    if at.is_dir() and not at.is_symlink():
        shutil.rmtree(at)
    elif at.exists() or at.is_symlink():
        at.unlink()
    if kind == "fifo":
        os.mkfifo(at)
    elif kind == "directory":
        at.mkdir()
    elif kind == "symlink":
        os.symlink(outside / "anything", at)
    else:
        at.write_bytes(b"")


def oversized_manifest():
    def apply(p, o, extra):
        with open(p / cd.MANIFEST, "r+b") as handle:  # sparse: no real 16 MiB written
            handle.truncate(cd.MAX_MANIFEST_BYTES + extra)
        return p
    return st.builds(
        lambda extra: ("oversized manifest", lambda p, o: apply(p, o, extra), {"bad_field"},
                       {"bad_field"}),
        st.integers(1, 1 << 20))


# -- mutations of the manifest's content (canonical, with a recomputed checkpoint_id) ------------

HOSTILE_PATHS = ["../x", "../../etc/passwd", "/abs", "/", "a\\b", "a//b", "./a", "a/./b", "a/",
                 ".hidden", "a\x00b", "\x00", cd.MANIFEST, "a b", "", "rng/../state.json",
                 "/".join(["d"] * 9), "x" * 256, "State.json", "rng", "state.json/x", "C:\\x",
                 "\u00e9"]
CLASHING = ("State.json", "state.json/x")  # hostile beside state.json: only ever added


def hostile_path():
    def change(manifest, path, mode):
        files = manifest["files"]
        if mode == "rename" and path not in CLASHING:
            files[path] = files.pop("state.json")
        else:
            files[path] = {"size": 1, "sha256": "0" * 64}
    return st.builds(
        lambda path, mode: ("hostile declared path",
                            lambda p, o: rewrite(p, lambda m: change(m, path, mode)),
                            {"bad_path"}, {"bad_path"}),
        st.sampled_from(HOSTILE_PATHS) | st.builds(
            lambda parts: "/".join(parts),
            st.lists(st.sampled_from(["..", ".", "", "x", "\x00", ".h", "a\\b"]), min_size=1,
                     max_size=5)).filter(lambda s: set(s.split("/")) - {"x"}),
        st.sampled_from(["rename", "add"]))


WRONG = [None, True, 1, -1, 1.5, "text", [], {}, [1], {"a": 1}]
OUTER_CODES = {"schema": "unsupported_schema", "checkpoint_type": "unsupported_type"}


def wrong_type():
    """A field the loader checks, set to a value of another type: (keys, its type, code)."""
    cases = [(("schema",), str, "unsupported_schema"),
             (("checkpoint_type",), str, "unsupported_type"),
             (("adapter",), str, "bad_field"), (("step",), int, "bad_field"),
             (("checkpoint_id",), str, "bad_field"), (("files",), dict, "bad_field"),
             (("files", "state.json"), dict, "bad_field"),
             (("files", "state.json", "size"), int, "bad_field"),
             (("files", "state.json", "sha256"), str, "bad_field"),
             (("progress",), dict, "bad_field"), (("progress", "complete"), bool, "bad_field"),
             (("progress", "committed_step"), int, "inconsistent_state")]

    def hostile(case, value):  # a value of the right type is another mutation; progress may be null
        keys, right, _ = case
        return type(value) is not right and (keys, value) != (("progress",), None)
    return st.tuples(st.sampled_from(cases), st.sampled_from(WRONG)).filter(
        lambda pair: hostile(*pair)).map(lambda pair: (
            "wrong type",
            lambda p, o: rewrite(p, lambda m: put(m, pair[0][0], pair[1]),
                                 recompute=pair[0][0] != ("checkpoint_id",)),
            {pair[0][2]}, {pair[0][2]}))


def unknown_field():
    def change(manifest, where, key):
        if where == "top":
            manifest[key] = 1
        else:
            manifest["files"]["state.json"][key] = 1
    return st.builds(
        lambda where, key: ("unknown field", lambda p, o: rewrite(p, lambda m: change(m, where, key)),
                            {"unknown_field" if where == "top" else "bad_field"},
                            {"unknown_field" if where == "top" else "bad_field"}),
        st.sampled_from(["top", "file entry"]),
        st.sampled_from(["created_at", "extra", "Schema", "files2", "\u00e9"])
        | st.text(min_size=1, max_size=10).filter(lambda k: k not in FIELDS
                                                  and k not in cd.OUTER_FIELDS
                                                  and k not in ("size", "sha256")))


def missing_field():
    return st.builds(
        lambda key: ("missing field",
                     lambda p, o: rewrite(p, lambda m: m.pop(key), recompute=key != "checkpoint_id"),
                     {OUTER_CODES.get(key, "bad_field")}, {OUTER_CODES.get(key, "bad_field")}),
        st.sampled_from(cd.OUTER_FIELDS))


def huge_number():
    """Numbers past 64 bits fail the strict parser; in range, the check of that field refuses."""
    cases = [(("step",), 2**63, "bad_field"), (("step",), 10**30, "bad_field"),
             (("step",), -(2**63) - 1, "bad_field"), (("step",), 2**63 - 1, "inconsistent_state"),
             (("step",), -1, "bad_field"),
             (("files", "state.json", "size"), 2**64, "bad_field"),
             (("files", "state.json", "size"), 2**63 - 1, "size_mismatch"),
             (("files", "state.json", "size"), -1, "bad_field"),
             (("progress", "committed_step"), 2**63 - 1, "inconsistent_state"),
             (("progress", "total_steps"), 0, "inconsistent_state"),
             (("seed",), 2**63, "bad_field"), (("seed",), "9" * 5000, "bad_field"),
             (("config", "learning_rate"), "1e999", "bad_field"),
             (("loss_history",), "-1e400", "bad_field")]
    return st.builds(
        lambda case: ("huge number", lambda p, o: _raw_value(p, case[0], case[1]), {case[2]},
                      {case[2]}),
        st.sampled_from(cases))


def _raw_value(path, keys, value):
    """Put a number (or its JSON text) at `keys`, canonically, id recomputed where JSON allows."""
    manifest = json.loads((path / cd.MANIFEST).read_bytes())
    if isinstance(value, int):
        put(manifest, keys, value)
        manifest["checkpoint_id"] = cd.content_id(manifest)
        (path / cd.MANIFEST).write_bytes(canonical_bytes(manifest) + b"\n")
        return
    put(manifest, keys, SENTINEL)
    raw = canonical_bytes(manifest).replace(json.dumps(SENTINEL).encode(), value.encode())
    (path / cd.MANIFEST).write_bytes(raw + b"\n")


def raw_text():
    """Duplicate keys, NaN/Infinity, deep nesting, non-canonical forms: the strict parser's refusals."""
    def duplicate(raw, key):
        return raw.replace(b'"seed":1234', b'"seed":1234,' + key + b':1234', 1)
    edits = [  # (kind, edit): each refused as bad_field
        ("duplicate key", lambda raw: duplicate(raw, b'"seed"')),
        ("duplicate key", lambda raw: duplicate(raw, b'"step"')),
        ("duplicate key", lambda raw: raw.replace(b'"step":3', b'"step":3,"step":3', 1)),
        ("duplicate key", lambda raw: raw.replace(b'"size":13', b'"size":13,"size":13', 1)),
        ("NaN", lambda raw: raw.replace(b'"seed":1234', b'"seed":NaN', 1)),
        ("NaN", lambda raw: raw.replace(b'0.25', b'Infinity', 1)),
        ("NaN", lambda raw: raw.replace(b'0.25', b'-Infinity', 1)),
        ("NaN", lambda raw: raw.replace(b'"total_steps":100', b'"total_steps":1e400', 1)),
        ("non-canonical", lambda raw: json.dumps(json.loads(raw), indent=1).encode()),
        ("non-canonical", lambda raw: raw.replace(b"\n", b"\r\n")),
        ("non-canonical", lambda raw: b" " + raw),
        ("non-canonical", lambda raw: raw.replace(b'"bot"', b'"\\u0062ot"', 1)),
        ("not an object", lambda raw: b"[" + raw.strip() + b"]\n"),
        ("not UTF-8", lambda raw: raw.replace(b'"bot"', b'"\xff\xfe"', 1)),
        ("BOM", lambda raw: b"\xef\xbb\xbf" + raw),
    ]
    same = ("equal value, other content", lambda raw: raw.replace(b'"seed":1234', b'"seed":1234.0', 1))
    return st.builds(
        lambda edit: (edit[0], lambda p, o: _edit_raw(p, edit[1]), {"bad_field"}, {"bad_field"}),
        st.sampled_from(edits)) | st.just((same[0], lambda p, o: _edit_raw(p, same[1]),
                                           {"checksum_mismatch"}, {"checksum_mismatch"}))


def _edit_raw(path, edit):
    raw = (path / cd.MANIFEST).read_bytes()
    changed = edit(raw)
    assert changed != raw
    (path / cd.MANIFEST).write_bytes(changed)


def deep_nesting():
    def apply(p, depth, kind, where):
        opening, closing = ("[", "]") if kind == "list" else ('{"a":', "}")
        value = opening * depth + ("" if kind == "list" else "0") + closing * depth
        _raw_value(p, where, value)
    return st.builds(
        lambda depth, kind, where: ("deep nesting", lambda p, o: apply(p, depth, kind, where),
                                    {"bad_field"}, {"bad_field"}),
        st.sampled_from([cd.MAX_JSON_DEPTH, 200, 900, 990, 5000, 100000])
        | st.integers(cd.MAX_JSON_DEPTH, 3000),
        st.sampled_from(["list", "dict"]),
        st.sampled_from([("seed",), ("config", "epochs"), ("progress", "next_cursor")]))


def semantic():
    """Well-formed manifests that lie, with a recomputed id or the stale one.

    (field, change, code with the new id, code with the stale id): the stale id is noticed
    unless a check that runs before the id check refuses first.
    """
    stale = "checksum_mismatch"
    cases = [
        ("schema", lambda m: m.update(schema="kiln.training-checkpoint.v2"), "unsupported_schema",
         "unsupported_schema"),
        ("type", lambda m: m.update(checkpoint_type="ppo"), "unsupported_type", "unsupported_type"),
        ("adapter", lambda m: m.update(adapter="other"), "inconsistent_state", stale),
        ("adapter", lambda m: m.update(adapter="../bot"), "bad_field", "bad_field"),
        ("step", lambda m: m.update(step=4), "inconsistent_state", stale),
        ("size", lambda m: m["files"]["state.json"].update(size=1), "size_mismatch", stale),
        ("sha256", lambda m: m["files"]["state.json"].update(sha256="0" * 64), "checksum_mismatch",
         stale),
        ("sha256", lambda m: m["files"]["state.json"].update(sha256="AB" * 32), "bad_field",
         "bad_field"),
        ("progress", lambda m: m["progress"].update(step=3), "bad_field", stale),
        ("progress", lambda m: m["progress"].update(committed_step=2), "inconsistent_state", stale),
        ("files", lambda m: m["files"].pop("state.json"), "extra_file", stale),
        ("files", lambda m: m["files"].update({"ghost.bin": {"size": 0, "sha256": "0" * 64}}),
         "missing_file", stale),
        ("files", lambda m: m["files"].update(
            {f"f{i}": {"size": 0, "sha256": "0" * 64} for i in range(cd.MAX_FILES)}), "bad_field",
         "bad_field"),
        ("caller field", lambda m: m.update(seed=4321), None, stale),
    ]

    def build(case, is_stale):
        field, change, fresh_code, stale_code = case
        assume(is_stale or fresh_code is not None)  # a new caller value with its id is valid
        code = stale_code if is_stale else fresh_code
        # a status load does not hash files: a wrong digest is noticed by full loads only
        light = None if (field, is_stale) == ("sha256", False) and code == stale else {code}
        return (f"lying {field}" + (", stale id" if is_stale else ""),
                lambda p, o: rewrite(p, change, recompute=not is_stale), {code}, light)
    return st.builds(build, st.sampled_from(cases), st.booleans())


FILE_MUTATIONS = st.one_of(flip_file(), flip_manifest(), resize_file(), resize_manifest(),
                           extra_file(), extra_directory(), sentinel(), missing(),
                           missing_directory(), renamed(), swapped(), renamed_directory())
LINK_MUTATIONS = st.one_of(symlinked(), symlinked_checkpoint(), hard_linked(), special_files(),
                           oversized_manifest())
MANIFEST_MUTATIONS = st.one_of(hostile_path(), wrong_type(), unknown_field(), missing_field(),
                               huge_number(), raw_text(), deep_nesting(), semantic())


def check(case, pristine, room, fuzz, prop):
    kind, apply, full_codes, light_codes = case
    path = fresh_copy(pristine, room)
    result = apply(path, room[1])
    if isinstance(result, Path):
        path = result
    elif not path.exists() and not path.is_symlink():  # renamed
        path = next(room[0].iterdir())
    with fuzz.case("kiln", prop):
        code = refused_code(path, full=True)
        assert code in full_codes, f"{kind}: full load gave {code!r}, expected {sorted(full_codes)}"
        code = refused_code(path, full=False)
        if light_codes is None:
            assert code is None, f"{kind}: a light load does not hash, yet it refused ({code})"
        else:
            assert code in light_codes, f"{kind}: light load gave {code!r}, expected {sorted(light_codes)}"


def test_file_mutations(pristine, room, fuzz):
    @fuzz.settings(400)
    @given(case=FILE_MUTATIONS)
    def run(case):
        check(case, pristine, room, fuzz, "files")

    run()
    fuzz.floor("kiln", "files", 300)


def test_links_fifos_and_size(pristine, room, fuzz):
    @fuzz.settings(250)
    @given(case=LINK_MUTATIONS)
    def run(case):
        check(case, pristine, room, fuzz, "links")

    run()
    fuzz.floor("kiln", "links", 60)


def test_manifest_mutations(pristine, room, fuzz):
    @fuzz.settings(400)
    @given(case=MANIFEST_MUTATIONS)
    def run(case):
        check(case, pristine, room, fuzz, "manifests")

    run()
    fuzz.floor("kiln", "manifests", 300)


def test_atheris_coverage_guided(pristine, tmp_path, fuzz):
    shutil.copytree(pristine, tmp_path / NAME)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "manifest").write_bytes((pristine / cd.MANIFEST).read_bytes())
    fuzz.atheris("kiln", "kiln", tmp_path, corpus, runs=3000)
