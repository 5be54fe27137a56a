"""Hostile `.riftckpt` archives: every mutation of a real archive is refused with CheckpointError.

Real dense, LoRA and QLoRA archives (and a deflated dense v1 one) of a tiny model are
mutated: flipped bytes, truncations, extra, missing, renamed, duplicated and resized
members, sizes in the ZIP directory that disagree with the data, zip bombs, hostile member
names and hostile manifests. Each case must raise CheckpointError (never another
exception) within CASE_SECONDS, the bombs within a traced-memory bound, and live objects
must be unchanged before and after. A manifest mutation that still loads (a value only
restore can judge) must be refused by restore into matching live objects, which must then
be unchanged too.
"""

import copy
import functools
import hashlib
import importlib.util
import io
import json
import random
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from trainer import Adam, TransformerConfig, checkpoints
from trainer.checkpoints import CheckpointError, TrainingCheckpoint
from trainer.training import CausalLanguageModelTrainer, TrainingLoopConfig, random_state_to_json

WORKER_PATH = Path(__file__).parents[1] / "engine" / "checkpoint_worker.py"
_spec = importlib.util.spec_from_file_location("fuzz_checkpoint_worker", WORKER_PATH)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

SMALL = dict(vocabulary_size=worker.VOCABULARY, maximum_context=6, model_width=16, head_count=4,
             kv_head_count=2, block_count=1, feed_forward_width=24)
RANDOM_SOURCE = {"kind": "random", "seed": 5}
LORA = {"rank": 2, "alpha": 4.0, "targets": ["q_proj", "v_proj", "down_proj"], "use_rslora": False,
        "initializer_seed": 0}
KINDS = {  # archive kind: how its model is built (the v1 archive is dense and deflated)
    "dense": {"lora": None, "quantize": None},
    "lora": {"lora": LORA, "quantize": None},
    "qlora": {"lora": LORA, "quantize": {"block_size": 32, "double_quantization": True}},
    "dense-v1": {"lora": None, "quantize": None},
}
V2_KINDS = ("dense", "lora", "qlora")
BOMB_PEAK = 16 << 20  # traced bytes a refused bomb may cost; the smallest bomb declares 60 MiB
SENTINEL = "kiln-fuzz-sentinel"


# -- archives built by hand ------------------------------------------------------------------


class Member:
    """One ZIP member as raw_zip writes it; every header field may lie.

    A plain class, not a dataclass: hypothesis prints dataclasses field by field, payloads too.
    """

    def __init__(self, name: bytes, payload: bytes, size: int, crc: int,
                 method: int = zipfile.ZIP_STORED, compressed: int | None = None,
                 at: int | None = None):
        self.name = name
        self.payload = payload  # what lies in the file: the stored bytes or a raw deflate stream
        self.size = size  # the uncompressed size both headers declare
        self.crc = crc
        self.method = method
        self.compressed = compressed  # the declared compressed size; None: len(payload)
        self.at = at  # the central directory points here instead (overlapping members)

    def __repr__(self):  # what a failing example prints
        return (f"Member({self.name!r}, {len(self.payload)} bytes, size={self.size}, "
                f"method={self.method}, compressed={self.compressed}, at={self.at})")


def stored(name, data) -> Member:
    name = name.encode("utf-8") if isinstance(name, str) else name
    return Member(name, data, len(data), zlib.crc32(data))


def raw_zip(members) -> bytes:
    """A plain ZIP (no ZIP64) of `members`, local headers then the central directory."""
    body, central = bytearray(), bytearray()
    for m in members:
        offset = len(body)
        compressed = len(m.payload) if m.compressed is None else m.compressed
        flags = 0x800 if any(b > 0x7F for b in m.name) else 0  # UTF-8 names
        body += struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, flags, m.method, 0, 0x21, m.crc,
                            compressed, m.size, len(m.name), 0) + m.name + m.payload
        central += struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 0x0314, 20, flags, m.method, 0, 0x21,
                               m.crc, compressed, m.size, len(m.name), 0, 0, 0, 0, 0o100644 << 16,
                               offset if m.at is None else m.at) + m.name
    count = len(members)
    return bytes(body + central + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count,
                                              len(central), len(body), 0))


def members_of(data: bytes) -> list:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return [stored(info.filename, archive.read(info)) for info in archive.infolist()]


def data_ranges(data: bytes) -> list:
    """[start, end) of every member's payload: the bytes whose change a reader must notice."""
    ranges = []
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for info in archive.infolist():
            name_length, extra_length = struct.unpack_from("<2H", data, info.header_offset + 26)
            start = info.header_offset + 30 + name_length + extra_length
            ranges.append((start, start + info.compress_size))
    return ranges


def manifest_id(manifest) -> str:
    content = {k: v for k, v in manifest.items() if k != "checkpoint_id"}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":"),
                                     ensure_ascii=True, allow_nan=False).encode()).hexdigest()


def with_manifest(members, text: bytes) -> bytes:
    return raw_zip([stored("manifest.json", text) if m.name == b"manifest.json" else m
                    for m in members])


# -- real archives and live objects ------------------------------------------------------------


def make_run(kind, steps=3, seed=0, fields=None, lora=None, source_spec=RANDOM_SOURCE,
             learning_rate=None):
    config = TransformerConfig(**{**SMALL, "initializer_seed": seed, **(fields or {})})
    spec = KINDS[kind]
    model = worker.build_model(config, spec["lora"] if lora is None else lora, spec["quantize"])
    optimizer = worker.build_adam(model, "contiguous")
    if learning_rate is not None:
        parameters = model.parameters() if model.lora_config is None else model.adapter_parameters()
        optimizer = Adam(parameters, learning_rate=learning_rate, beta1=0.85, beta2=0.99,
                         weight_decay=0.01)
    source = worker.build_source(source_spec, config.maximum_context)
    if steps:
        CausalLanguageModelTrainer(model, optimizer).run(source, TrainingLoopConfig(steps=steps))
    return model, optimizer, source


def write_v1(path, model, optimizer):
    """The documented dense v1 layout: params/, adam/m/, adam/v/ raw <f4 members, deflated."""
    adam = optimizer.state_dict()
    members = {}
    for name, value in model.state_dict().items():
        members[f"params/{name}.bin"] = value.astype("<f4").tobytes()
        members[f"adam/m/{name}.bin"] = adam["first_moment"][name].astype("<f4").tobytes()
        members[f"adam/v/{name}.bin"] = adam["second_moment"][name].astype("<f4").tobytes()
    manifest = {
        "schema": "kiln.riftckpt", "format_version": 1, "config": model.config.to_dict(),
        "parameters": [{"name": n, "shape": list(v.shape)} for n, v in model.state_dict().items()],
        "optimizer": {"hyperparameters": adam["hyperparameters"], "step": adam["step"],
                      "beta1_power": adam["beta1_power"], "beta2_power": adam["beta2_power"]},
        "global_step": 3, "python_random_state": random_state_to_json(random.getstate()),
        "metadata": {"run": "v1"},
        "sha256": {n: hashlib.sha256(d).hexdigest() for n, d in members.items()},
    }
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("manifest.json", json.dumps(manifest, indent=2))
        for name, data in members.items():
            archive.writestr(name, data)


class Original:
    """A real archive: its bytes, members, loaded manifest and member payload ranges."""

    def __init__(self, data: bytes, members: list, manifest: dict, ranges: list):
        self.data = data
        self.members = members
        self.manifest = manifest  # the loaded (v2) manifest: what an unchanged load gives again
        self.ranges = ranges  # [start, end) of each member's payload

    def __repr__(self):  # strategies built over it print it
        return f"Original({len(self.data)} bytes, {len(self.members)} members)"


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    folder = tmp_path_factory.mktemp("riftckpt")
    random.seed(11)
    result = {}
    for kind in KINDS:
        model, optimizer, source = make_run(kind)
        path = folder / f"{kind}.riftckpt"
        if kind == "dense-v1":
            write_v1(path, model, optimizer)
        else:
            TrainingCheckpoint.capture(model, optimizer, source=source, global_step=3,
                                       metadata={"run": kind, "tags": ["a", 1, 2.5, None]}).save(path)
        data = path.read_bytes()
        manifest = TrainingCheckpoint.load(path).manifest()
        result[kind] = Original(data, members_of(data), manifest, data_ranges(data))
    return result


@pytest.fixture(scope="module")
def live():
    """Live objects per kind that no load may touch (loads never restore into them)."""
    return {kind: make_run(kind, steps=1, seed=7) for kind in KINDS}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("cases") / "case.riftckpt"


def snapshot(model, optimizer, source=None):
    return {"base": worker.fp32_base(model),
            "adapters": None if model.lora_config is None else model.adapter_state_dict(),
            "packed": worker.packed_arrays(model),
            "packed_objects": [] if model.quantization is None
            else [id(t) for t in model.packed_state().values()],
            "quantization": model.quantization, "adam": optimizer.state_dict(),
            "random": random.getstate(),
            "source": None if source is None else source.checkpoint_state()}


def assert_same(a, b, where="state"):
    """Exact equality of nested dicts/lists/arrays/scalars (arrays by dtype, shape and ==)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{index}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype, where
        assert np.array_equal(a, b), where
    else:
        assert type(a) is type(b) and a == b, where


def load_refused(path, data, live_objects):
    """Write `data`; load must raise CheckpointError and leave the live objects as they were.

    Returns the loaded checkpoint instead when the archive loads.
    """
    path.write_bytes(data)
    before = snapshot(*live_objects)
    try:
        checkpoint = TrainingCheckpoint.load(path)
    except CheckpointError:
        assert_same(before, snapshot(*live_objects))
        return None
    assert_same(before, snapshot(*live_objects))
    return checkpoint


def restore_refused(kind, checkpoint, source=True):
    """Restore into fresh objects that fit the original archive: refused, nothing changed."""
    model, optimizer, fresh_source = make_run(kind, steps=1, seed=7)
    source = fresh_source if source else None
    random.seed(99)
    before = snapshot(model, optimizer, source)
    with pytest.raises(CheckpointError):
        checkpoint.restore(model, optimizer, source)
    assert_same(before, snapshot(model, optimizer, source))


# -- controls: unmutated rebuilds load, so refusals below are the mutation's doing -----------------


def test_rebuilt_archives_load_and_restore(originals, scratch):
    for kind, original in originals.items():
        scratch.write_bytes(raw_zip(original.members))
        checkpoint = TrainingCheckpoint.load(scratch)
        assert checkpoint.manifest() == original.manifest
        model, optimizer, source = make_run(kind, steps=1, seed=7)
        checkpoint.restore(model, optimizer, None if kind == "dense-v1" else source)
        assert worker.trained_values(model).keys()


# -- ZIP-level mutations -------------------------------------------------------------------------


@st.composite
def flips(draw, originals):
    kind = draw(st.sampled_from(sorted(KINDS)))
    data = originals[kind].data
    in_payload = draw(st.booleans())
    if in_payload:  # half the flips land in member data, the rest anywhere (headers, directory)
        start, end = draw(st.sampled_from(originals[kind].ranges))
        assume(end > start)
        offset = draw(st.integers(start, end - 1))
    else:
        offset = draw(st.integers(0, len(data) - 1))
    masks = draw(st.lists(st.integers(1, 255), min_size=1, max_size=3))
    return kind, offset, masks


def test_flipped_bytes(originals, live, scratch, fuzz):
    @fuzz.settings(400)
    @given(case=flips(originals))
    def run(case):
        kind, offset, masks = case
        data = bytearray(originals[kind].data)
        for i, mask in enumerate(masks):
            data[min(offset + i, len(data) - 1)] ^= mask
        with fuzz.case("riftckpt", "flipped bytes") as outcome:
            checkpoint = load_refused(scratch, bytes(data), live[kind])
            if checkpoint is not None:
                # only bytes the reader ignores: ZIP times, versions and attributes, or deflate
                # bits without effect (v1); stored member data is content, so never
                if kind != "dense-v1":
                    payload = any(start <= offset < end for start, end in originals[kind].ranges)
                    assert not payload, f"a flip at {offset} in stored member data was not noticed"
                assert checkpoint.manifest() == originals[kind].manifest  # digests: arrays too
                outcome["kind"] = "flips of ignored ZIP bytes loaded unchanged"

    run()
    fuzz.floor("riftckpt", "flipped bytes", 350)


LOCAL_FIELDS = {"version": (4, 2), "flags": (6, 2), "method": (8, 2), "time": (10, 2),
                "date": (12, 2), "crc": (14, 4), "compressed": (18, 4), "size": (22, 4),
                "name length": (26, 2), "extra length": (28, 2)}
CENTRAL_FIELDS = {"made by": (4, 2), "version": (6, 2), "flags": (8, 2), "method": (10, 2),
                  "time": (12, 2), "date": (14, 2), "crc": (16, 4), "compressed": (20, 4),
                  "size": (24, 4), "name length": (28, 2), "extra length": (30, 2),
                  "comment length": (32, 2), "disk": (34, 2), "internal": (36, 2),
                  "external": (38, 4), "offset": (42, 4)}
END_FIELDS = {"disk": (4, 2), "directory disk": (6, 2), "entries here": (8, 2),
              "entries": (10, 2), "directory size": (12, 4), "directory offset": (16, 4),
              "comment length": (20, 2)}


def header_starts(data: bytes) -> dict:
    """{"local"|"central"|"end": [offset of each such header]}."""
    end = data.rindex(b"PK\x05\x06")
    count, size, offset = struct.unpack_from("<H2L", data, end + 10)
    central, position = [], offset
    for _ in range(count):
        central.append(position)
        lengths = struct.unpack_from("<3H", data, position + 28)
        position += 46 + sum(lengths)
    local = [struct.unpack_from("<L", data, at + 42)[0] for at in central]
    return {"local": local, "central": central, "end": [end]}


@st.composite
def header_edits(draw, originals):
    """One field of one ZIP header set to another value: small, extreme or off by one."""
    kind = draw(st.sampled_from(sorted(KINDS)))
    header = draw(st.sampled_from(["local", "central", "end"]))
    fields = {"local": LOCAL_FIELDS, "central": CENTRAL_FIELDS, "end": END_FIELDS}[header]
    field = draw(st.sampled_from(sorted(fields)))
    at = draw(st.sampled_from(header_starts(originals[kind].data)[header]))
    offset, width = fields[field]
    old = int.from_bytes(originals[kind].data[at + offset:at + offset + width], "little")
    top = (1 << (8 * width)) - 1
    value = draw(st.sampled_from([0, 1, top, top - 1, (old + 1) & top, (old - 1) & top,
                                  old ^ 0x80, 0x3F, 0x40, 0x14, 0x2D])
                 | st.integers(0, top))
    assume(value != old)
    return kind, header, field, at + offset, value.to_bytes(width, "little")


def test_zip_header_fields(originals, live, scratch, fuzz):
    @fuzz.settings(400)
    @given(case=header_edits(originals))
    def run(case):
        kind, header, field, offset, value = case
        data = bytearray(originals[kind].data)
        data[offset:offset + len(value)] = value
        with fuzz.case("riftckpt", "ZIP header fields") as outcome:
            checkpoint = load_refused(scratch, bytes(data), live[kind])
            if checkpoint is not None:  # a field the reader ignores (times, versions, attributes)
                assert checkpoint.manifest() == originals[kind].manifest, (header, field)
                outcome["kind"] = "flips of ignored ZIP bytes loaded unchanged"

    run()
    fuzz.floor("riftckpt", "ZIP header fields", 350)


def test_truncations(originals, live, scratch, fuzz):
    @fuzz.settings(200)
    @given(kind=st.sampled_from(sorted(KINDS)), fraction=st.floats(0, 1, exclude_max=True),
           tail=st.binary(max_size=64))
    def run(kind, fraction, tail):
        data = originals[kind].data
        cut = data[:int(len(data) * fraction)]
        with fuzz.case("riftckpt", "truncations") as outcome:
            assert load_refused(scratch, cut, live[kind]) is None
            if data.startswith(cut + tail):
                return
            checkpoint = load_refused(scratch, cut + tail, live[kind])  # garbage after the cut
            if checkpoint is not None:  # it rebuilt the end record: bytes after it are ignored
                assert checkpoint.manifest() == originals[kind].manifest
                outcome["kind"] = "flips of ignored ZIP bytes loaded unchanged"

    run()
    fuzz.floor("riftckpt", "truncations", 150)


MEMBER_EDITS = ("drop", "add", "rename", "swap", "duplicate", "resize")
PLAUSIBLE = st.sampled_from(["model/extra.f32", "adapter/x.f32", "adam/first_moment/x.f32",
                             "nf4/x/packed.u8", "params/x.bin", "manifest.json.bak", "README",
                             "model/model.norm.weight.f32", "adam/m/model.norm.weight.bin"])


@st.composite
def member_edits(draw, originals):
    kind = draw(st.sampled_from(sorted(KINDS)))
    members = list(originals[kind].members)
    edit = draw(st.sampled_from(MEMBER_EDITS))
    index = draw(st.integers(0, len(members) - 1))
    names = {m.name for m in members}
    if edit == "drop":
        drop = set(draw(st.lists(st.integers(0, len(members) - 1), min_size=1, max_size=4)) + [index])
        members = [m for i, m in enumerate(members) if i not in drop]
    elif edit == "add":
        name = draw(PLAUSIBLE | st.text(st.characters(codec="utf-8", exclude_characters="\x00"),
                                        min_size=1, max_size=40))
        assume(name.encode() not in names)
        members.insert(draw(st.integers(0, len(members))), stored(name, draw(st.binary(max_size=256))))
    elif edit == "rename":
        name = draw(PLAUSIBLE | st.text(st.characters(codec="utf-8", exclude_characters="\x00"),
                                        min_size=1, max_size=40))
        assume(name.encode() not in names)
        members[index] = stored(name, members[index].payload)
    elif edit == "swap":
        other = draw(st.integers(0, len(members) - 1))
        assume(members[index].payload != members[other].payload)
        a, b = members[index], members[other]
        members[index], members[other] = stored(b.name, a.payload), stored(a.name, b.payload)
    elif edit == "duplicate":
        copy_of = members[index]
        payload = draw(st.sampled_from([copy_of.payload, copy_of.payload[::-1], b""]))
        members.insert(draw(st.integers(0, len(members))), stored(copy_of.name, payload))
    else:  # resize: a consistent ZIP whose member holds more or fewer bytes than the manifest says
        payload = members[index].payload
        delta = draw(st.integers(-len(payload), 64).filter(lambda d: d != 0))
        payload = payload[:len(payload) + delta] if delta < 0 else payload + bytes(delta)
        members[index] = stored(members[index].name, payload)
    return kind, edit, members


def test_member_set_edits(originals, live, scratch, fuzz):
    @fuzz.settings(400)
    @given(case=member_edits(originals))
    def run(case):
        kind, edit, members = case
        data = raw_zip(members)
        with fuzz.case("riftckpt", "member set"):
            assert load_refused(scratch, data, live[kind]) is None, edit

    run()
    fuzz.floor("riftckpt", "member set", 300)


HOSTILE_NAMES = st.sampled_from([
    "../manifest.json", "model/../manifest.json", "/manifest.json", "/etc/passwd", "//x",
    "model\\model.norm.weight.f32", "..\\..\\x", "C:/x", "C:\\x", "model//x.f32", "./manifest.json",
    "model/./x.f32", "model/", "model/x.f32/", ".", "..", "", "manifest.json\x00",
    "manifest.json\x00.txt", "model/x\x00/../../y", "\x00", "x" * 60000, "model/" + "../" * 200 + "x",
])


@st.composite
def hostile_names(draw, originals):
    kind = draw(st.sampled_from(sorted(KINDS)))
    members = list(originals[kind].members)
    name = draw(HOSTILE_NAMES | st.builds(
        lambda parts, sep: sep.join(parts),
        st.lists(st.sampled_from(["..", ".", "", "model", "x.f32", "\x00", "C:", "/"]), min_size=1,
                 max_size=6),
        st.sampled_from(["/", "\\"])))
    index = draw(st.integers(0, len(members) - 1))
    how = draw(st.sampled_from(["rename", "add", "NUL suffix"]))
    if how == "NUL suffix":  # the member's own name, then NUL: a reader that cuts at NUL sees it intact
        name = members[index].name.decode() + "\x00" + draw(st.sampled_from(["", "x", "/../y"]))
    if how == "add":
        members.insert(index, stored(name, draw(st.binary(max_size=64))))
    else:
        members[index] = Member(name.encode(), members[index].payload, members[index].size,
                                members[index].crc)
    return kind, name, members


def test_hostile_member_names(originals, live, scratch, fuzz):
    @fuzz.settings(250)
    @given(case=hostile_names(originals))
    def run(case):
        kind, name, members = case
        data = raw_zip(members)
        with fuzz.case("riftckpt", "member names"):
            assert load_refused(scratch, data, live[kind]) is None, repr(name)

    run()
    fuzz.floor("riftckpt", "member names", 150)


@st.composite
def lying_sizes(draw, originals):
    """The directory's declared sizes (what zipfile trusts) disagree with the bytes present."""
    kind = draw(st.sampled_from(sorted(KINDS)))
    members = list(originals[kind].members)
    index = draw(st.integers(0, len(members) - 1))
    m = members[index]
    real = len(m.payload)
    declared = st.one_of(st.integers(0, 2 * real + 16), st.sampled_from([2**31, 2**32 - 1]))
    size = draw(declared)
    compressed = draw(st.one_of(st.none(), declared))
    method = draw(st.sampled_from([zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED]))
    assume((size, compressed, method) != (real, None, zipfile.ZIP_STORED))
    assume(not (size == real and compressed == real and method == zipfile.ZIP_STORED))
    members[index] = Member(m.name, m.payload, size, m.crc, method, compressed)
    return kind, members


def test_declared_sizes_that_lie(originals, live, scratch, fuzz):
    @fuzz.settings(250)
    @given(case=lying_sizes(originals))
    def run(case):
        kind, members = case
        data = raw_zip(members)
        with fuzz.case("riftckpt", "declared sizes"):
            assert load_refused(scratch, data, live[kind]) is None

    run()
    fuzz.floor("riftckpt", "declared sizes", 200)


# -- zip bombs ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def zeros_stream(size: int) -> bytes:
    """A raw deflate stream of `size` zero bytes, built from one repeated full-flush block."""
    unit = 1 << 20
    assert size % unit == 0
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = compressor.compress(bytes(unit)) + compressor.flush(zlib.Z_FULL_FLUSH)
    return block * (size // unit) + compressor.flush(zlib.Z_FINISH)


def bomb_member(name, size, crc=0) -> Member:
    # crc 0 is wrong: a reader that inflated the member would notice only after allocating
    # `size` bytes, which the traced-memory bound catches
    return Member(name.encode(), zeros_stream(size), size, crc, zipfile.ZIP_DEFLATED)


def consistent_bomb(original, size):
    """A LoRA archive whose manifest really declares a `size`-byte embedding, deflated to ~size/1000.

    The embedding's CRC and SHA-256 are right, so without a size bound the archive loads.
    """
    manifest = copy.deepcopy(original.manifest)
    width = manifest["model"]["config"]["model_width"]
    vocabulary = size // (4 * width)
    manifest["model"]["config"]["vocabulary_size"] = vocabulary
    manifest["model"]["config"]["tie_embeddings"] = True
    zeros, crc, unit = hashlib.sha256(), 0, bytes(1 << 20)
    for _ in range(size >> 20):
        zeros.update(unit)
        crc = zlib.crc32(unit, crc)
    entries = [e for e in manifest["model"]["parameters"] if e["name"] != "lm_head.weight"]
    entries[0].update(shape=[vocabulary, width], bytes=size, sha256=zeros.hexdigest())
    manifest["model"]["parameters"] = entries
    manifest["checkpoint_id"] = manifest_id(manifest)
    embed = entries[0]["member"].encode()
    members = [stored("manifest.json", json.dumps(manifest).encode())]
    members += [bomb_member(embed.decode(), size, crc) if m.name == embed else m
                for m in original.members
                if m.name not in (b"manifest.json", b"model/lm_head.weight.f32")]
    return raw_zip(members)


# CPU seconds a member of a many-member archive may cost. On the slowest CI host (an AVX2-only EPYC), idle, 60,000
# members took 0.94 s and every other zip-bomb case at most 0.37 s; in one CI run under load a zip-bomb case took
# 2.03 s, past the flat CASE_SECONDS. 100 us a member (6 s for 60,000) still fails a check that grows with the
# square of the members (minutes at this count)
MEMBER_CPU_SECONDS = 1e-4


def bombs(originals):
    """(name, archive bytes): the manifest, an array, an extra member, a consistent archive, overlaps."""
    lora = originals["lora"]
    cases = []
    for size in (60 << 20, 1 << 30, (4 << 30) - (1 << 20)):
        for kind in V2_KINDS:
            members = originals[kind].members
            manifest = Member(b"manifest.json", zeros_stream(60 << 20), 60 << 20, 0,
                              zipfile.ZIP_DEFLATED)  # under the 64 MiB manifest limit
            cases.append((f"{kind} manifest 60 MiB", raw_zip([manifest] + members[1:])))
            cases.append((f"{kind} array {size >> 20} MiB",
                          raw_zip(members[:1] + [bomb_member(members[1].name.decode(), size)]
                                  + members[2:])))
            cases.append((f"{kind} extra member {size >> 20} MiB",
                          raw_zip(members + [bomb_member("model/extra.f32", size)])))
            bomb = bomb_member("x0000", size)  # 2000 directory entries over the same bytes
            overlaps = [Member(b"x%04d" % i, b"", size, 0, zipfile.ZIP_DEFLATED,
                               compressed=len(bomb.payload), at=0) for i in range(1, 2000)]
            cases.append((f"{kind} overlapping {size >> 20} MiB", raw_zip([bomb] + overlaps)))
    cases.append(("lora consistent 256 MiB embedding", consistent_bomb(lora, 256 << 20)))
    return cases


def test_zip_bombs_are_refused_before_inflating(originals, live, scratch, fuzz):
    for name, data in bombs(originals):
        kind = name.split()[0]
        assert len(data) < (5 << 20), name  # small on disk ...
        scratch.write_bytes(data)
        with fuzz.case("riftckpt", "zip bombs", memory_bytes=BOMB_PEAK):
            with pytest.raises(CheckpointError, match="declare"):  # ... refused by declared size
                TrainingCheckpoint.load(scratch)
        assert load_refused(scratch, data, live[kind]) is None
    for count in (20_000, 60_000):  # many members: every check must stay linear in their number
        members = originals["dense"].members + [stored(f"m{i}", b"") for i in range(count)]
        scratch.write_bytes(raw_zip(members))
        with fuzz.case("riftckpt", "zip bombs", cpu_seconds=count * MEMBER_CPU_SECONDS):
            with pytest.raises(CheckpointError, match="unexpected member"):
                TrainingCheckpoint.load(scratch)
    fuzz.floor("riftckpt", "zip bombs", 39)


# -- hostile manifests -------------------------------------------------------------------------

# values a field may never hold, by the type it holds (a float field may hold an int in
# TransformerConfig, an absent value null; those substitutions are not hostile)
WRONG_TYPES = {
    dict: ["text", 1, 1.5, True, None, []],
    list: ["text", 1, True, None, {}],
    str: [1, 1.5, True, None, [], {}],
    bool: [1, 0, "true", None, []],
    int: ["1", 1.5, True, None, [], {}],
    float: ["1.0", True, None, [], {}],
    type(None): ["null", True, [], {}, 0],
}
HUGE = [2**63, 2**64, -(2**63) - 1, 10**30, -(10**30), 10**4000, 1e308, -1e308, 5e-324, -1]
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e400", "-1e999"]
MUTATIONS = ("unknown field", "missing field", "wrong type", "huge number", "non-finite",
             "duplicate key", "deep nesting", "drifted value")
# valid values the archive may hold that the live objects contradict: the load succeeds and
# restore must refuse before it changes anything
DRIFTS = [
    (("optimizer", "hyperparameters", "learning_rate"), lambda v: v * 2),
    (("optimizer", "hyperparameters", "weight_decay"), lambda v: v + 0.5),
    (("optimizer", "hyperparameters", "epsilon"), lambda v: v * 10),
    (("model", "config", "rope_theta"), lambda v: v * 2),
    (("model", "config", "norm_epsilon"), lambda v: v * 2),
    (("model", "config", "initializer_range"), lambda v: v * 2),
    (("model", "config", "attention_block_size"), lambda v: v * 2),
    (("model", "config", "loss_route"), lambda v: "kt_tape_flce"),
    (("model", "config", "loss_chunk_tokens"), lambda v: v + 1),
    (("adapter", "config", "alpha"), lambda v: v * 2),
    (("adapter", "config", "use_rslora"), lambda v: not v),
    (("source", "state", "fingerprint"), lambda v: "f" * 64),
    (("source", "state", "kind"), lambda v: "SequenceWindowBatchSource"),
    (("source",), lambda v: None),
]
FREE = ("initializer_seed",)  # restore ignores it: any valid value is a legitimate archive


def nodes(value, path=()):
    """(path, value) of every node, skipping the user's metadata and most random-state words."""
    yield path, value
    if path[:1] == ("metadata",):
        return
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else ()
    for key, child in items:
        if path[-1:] == ("internal",) and 0 < key < 623:
            continue
        if key in FREE:
            continue
        yield from nodes(child, path + (key,))


def put(tree, path, value):
    node = tree
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def render(manifest, path, raw: str, recompute: bool) -> bytes:
    """The manifest with the node at `path` replaced by the JSON text `raw`.

    recompute: give it the checkpoint_id of its new content where that content is JSON the
    id can cover (so the loader looks past the id); otherwise the old id stays.
    """
    if not path:
        data = raw.encode()
    else:
        manifest = copy.deepcopy(manifest)
        put(manifest, path, SENTINEL)
        data = json.dumps(manifest, indent=1).replace(json.dumps(SENTINEL), raw, 1).encode()
    if recompute and path != ("checkpoint_id",):
        try:
            parsed = json.loads(data)
            if isinstance(parsed, dict) and "checkpoint_id" in parsed:
                parsed["checkpoint_id"] = manifest_id(parsed)
                data = json.dumps(parsed, indent=1).encode()
        except (ValueError, RecursionError):
            pass
    return data


@st.composite
def manifest_mutations(draw, originals):
    kind = draw(st.sampled_from(V2_KINDS))
    manifest = originals[kind].manifest
    candidates = list(nodes(manifest))
    mutation = draw(st.sampled_from(MUTATIONS))
    # the parser refuses duplicate keys and non-finite numbers, a JSON round trip would drop them
    recompute = mutation not in ("duplicate key", "non-finite") and draw(st.booleans())
    if mutation in ("unknown field", "missing field", "duplicate key"):
        candidates = [(p, v) for p, v in candidates if isinstance(v, dict) and v
                      and p[:1] != ("metadata",)]
    elif mutation in ("huge number", "non-finite"):
        candidates = [(p, v) for p, v in candidates if type(v) in (int, float)]
    elif mutation == "drifted value":
        path, drift = draw(st.sampled_from([d for d in DRIFTS
                                            if kind != "dense" or d[0][0] != "adapter"]))
        value = manifest
        for key in path:
            value = value[key]
        return kind, mutation, path, render(manifest, path, json.dumps(drift(value)), True)
    else:
        candidates = [(p, v) for p, v in candidates if p]
    path, value = draw(st.sampled_from(candidates))
    if mutation == "unknown field":
        key = draw(st.sampled_from(["extra", "unknown", "Name", "schema_v3", "__proto__"])
                   | st.text(max_size=8))
        assume(key not in value)
        changed = {**value, key: draw(st.sampled_from([None, 0, "x", [], {}]))}
        text = json.dumps(changed)
    elif mutation == "missing field":
        key = draw(st.sampled_from(sorted(value)))
        text = json.dumps({k: v for k, v in value.items() if k != key})
    elif mutation == "wrong type":
        text = json.dumps(draw(st.sampled_from(WRONG_TYPES[type(value)])))
    elif mutation == "huge number":
        huge = draw(st.sampled_from(HUGE))
        assume(huge != value)
        text = json.dumps(huge)
    elif mutation == "non-finite":
        text = draw(st.sampled_from(NON_FINITE))
    elif mutation == "duplicate key":
        key = draw(st.sampled_from(sorted(value)))
        again = draw(st.sampled_from([value[key], None, "other"]))
        pairs = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in value.items()]
        pairs.insert(draw(st.integers(0, len(pairs))), f"{json.dumps(key)}: {json.dumps(again)}")
        text = "{" + ", ".join(pairs) + "}"
    else:  # nested past the limit wherever it starts (the path adds its own depth)
        depth = draw(st.sampled_from([checkpoints.MAX_MANIFEST_DEPTH, 200, 990, 5000, 100000])
                     | st.integers(checkpoints.MAX_MANIFEST_DEPTH - len(path), 3000))
        if draw(st.booleans()):
            text = "[" * depth + "]" * depth
        else:
            text = '{"a":' * depth + "0" + "}" * depth
    return kind, mutation, path, render(manifest, path, text, recompute)


def _set(keys, value):
    return lambda m: put(m, keys, value)


def _sizes(m):  # head_count x head_size overflows what an error message may print
    m["model"]["config"].update(head_size=10**4000, head_count=10**4000)


# found by this suite: each once hung, crashed with another exception or ran out of memory
REGRESSIONS = [
    ("block_count 10^12", _set(("model", "config", "block_count"), 10**12), None),
    ("head sizes 10^4000", _sizes, None),
    ("step 10^4000", _set(("optimizer", "step"), 10**4000), None),
    ("400-dimensional shape", _set(("model", "parameters", 0, "shape"), [2**63 - 1] * 400), None),
    ("metadata 1e400", _set(("metadata",), SENTINEL), '{"x": 1e400}'),
    ("metadata nested 500 deep", _set(("metadata",), SENTINEL), '{"a":' * 500 + "0" + "}" * 500),
    ("metadata nested 100000 deep", _set(("metadata",), SENTINEL), "[" * 100000 + "]" * 100000),
]


def check_manifest(kind, text, originals, live, scratch, fuzz, what):
    data = with_manifest(originals[kind].members, text)
    with fuzz.case("riftckpt", "manifests") as outcome:
        checkpoint = load_refused(scratch, data, live[kind])
        if checkpoint is not None:  # a value only the live objects can judge
            assert checkpoint.manifest() != originals[kind].manifest, what
            restore_refused(kind, checkpoint)
            outcome["kind"] = "refused at restore"


def test_hostile_manifests(originals, live, scratch, fuzz):
    for kind in V2_KINDS:
        for name, change, raw in REGRESSIONS:
            manifest = copy.deepcopy(originals[kind].manifest)
            change(manifest)
            manifest["checkpoint_id"] = manifest_id(manifest) if raw is None else "0" * 64
            text = json.dumps(manifest, indent=1)
            if raw is not None:
                text = text.replace(json.dumps(SENTINEL), raw)
                manifest = json.loads(text) if "1e400" not in raw and len(raw) < 5000 else None
                if manifest is not None:  # give it the id of its content, so only depth refuses
                    manifest["checkpoint_id"] = manifest_id(manifest)
                    text = json.dumps(manifest, indent=1)
            check_manifest(kind, text.encode(), originals, live, scratch, fuzz, name)

    @fuzz.settings(400)
    @given(case=manifest_mutations(originals))
    def run(case):
        kind, mutation, path, text = case
        check_manifest(kind, text, originals, live, scratch, fuzz, (mutation, path))

    run()
    fuzz.floor("riftckpt", "manifests", 350 + 3 * len(REGRESSIONS))


# -- restore refusals leave live state unchanged ----------------------------------------------

TARGETS = {  # how the live objects differ from the archive's; each must be refused before any change
    "data fingerprint": dict(source_spec={"kind": "random", "seed": 5, "token_offset": 1}),
    "source kind": dict(source_spec={"kind": "sequence", "seed": 5}),
    "model width": dict(fields={"model_width": 32}),
    "kv heads": dict(fields={"kv_head_count": 1}),
    "attention": dict(fields={"attention_algorithm": "tiled"}),
    "tied embeddings": dict(fields={"tie_embeddings": True}),
    "learning rate": dict(learning_rate=1e-3),
    "lora rank": dict(lora={**LORA, "rank": 4}),
    "lora targets": dict(lora={**LORA, "targets": ["q_proj"]}),
    "source none": {},
}


def test_restore_refusals_leave_live_state_unchanged(originals, scratch, fuzz):
    loaded = {}
    for kind in V2_KINDS:
        scratch.write_bytes(originals[kind].data)
        loaded[kind] = TrainingCheckpoint.load(scratch)

    @fuzz.settings(150)
    @given(kind=st.sampled_from(V2_KINDS), target=st.sampled_from(sorted(TARGETS)),
           steps=st.integers(0, 2), seed=st.integers(0, 2**32 - 1))
    def run(kind, target, steps, seed):
        spec = dict(TARGETS[target])
        if kind == "dense" and "lora" in spec:
            spec["lora"] = LORA  # an adapter where the archive has none
        model, optimizer, source = make_run(kind, steps=steps, seed=seed % 50, **spec)
        source = None if target == "source none" else source
        with fuzz.case("riftckpt", "restore refusals"):
            random.seed(seed)
            before = snapshot(model, optimizer, source)
            with pytest.raises(CheckpointError, match="restore refused"):
                loaded[kind].restore(model, optimizer, source)
            assert_same(before, snapshot(model, optimizer, source))

    run()
    fuzz.floor("riftckpt", "restore refusals", 100)


# -- coverage-guided: atheris from the real archives ------------------------------------------


def test_atheris_coverage_guided(originals, tmp_path, fuzz):
    corpus = tmp_path / "archives"
    corpus.mkdir()
    for kind in ("dense", "dense-v1"):  # the smallest seeds: libFuzzer mutates whole inputs
        (corpus / kind).write_bytes(originals[kind].data)
    fuzz.atheris("riftckpt", "riftckpt", tmp_path, corpus, runs=1500)
    corpus = tmp_path / "manifests"
    corpus.mkdir()
    (corpus / "lora").write_bytes(json.dumps(originals["lora"].manifest, indent=1).encode())
    (tmp_path / "base.riftckpt").write_bytes(originals["lora"].data)
    fuzz.atheris("riftckpt", "riftckpt-manifest", tmp_path, corpus, runs=1000)
