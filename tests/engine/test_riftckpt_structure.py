"""The `.riftckpt` ZIP structure is canonical: every byte of a real archive is checked.

A one-bit flip anywhere in a real archive is refused with a code, live state untouched;
targeted structural edits (sizes, gaps, trailing bytes, comments, duplicates, order, extra
fields, timestamps, compression) are refused as noncanonical_archive naming offset and field;
the writer's bytes equal what zipfile wrote for save() before, ZIP64 layouts included.
"""

import importlib.util
import io
import random
import struct
import time
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest

from trainer import DecoderOnlyTransformer, TransformerConfig, checkpoint_zip
from trainer.checkpoints import CheckpointError, TrainingCheckpoint
from trainer.training import CausalLanguageModelTrainer, TrainingLoopConfig

WORKER_PATH = Path(__file__).with_name("checkpoint_worker.py")
_spec = importlib.util.spec_from_file_location("structure_checkpoint_worker", WORKER_PATH)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

TINY = dict(vocabulary_size=worker.VOCABULARY, maximum_context=4, model_width=4, head_count=2,
            kv_head_count=1, block_count=1, feed_forward_width=4, tie_embeddings=True)
SOURCE = {"kind": "random", "seed": 5}
# what a damaged archive may be refused as, before any member is trusted
STRUCTURAL = {"noncanonical_archive", "corrupt_member", "zip_bomb", "unsafe_member"}


def make_run(seed=0, steps=2):
    config = TransformerConfig(**{**TINY, "initializer_seed": seed})
    model = DecoderOnlyTransformer(config)
    optimizer = worker.build_adam(model, "contiguous")
    source = worker.build_source(SOURCE, config.maximum_context)
    CausalLanguageModelTrainer(model, optimizer).run(source, TrainingLoopConfig(steps=steps))
    return model, optimizer, source


def live_state(model, optimizer, source):
    """Every live array and the RNG states a load would restore into, as comparable values."""
    adam = optimizer.state_dict()
    arrays = [*model.state_dict().values(), *adam["first_moment"].values(), *adam["second_moment"].values()]
    return arrays, (adam["step"], adam["beta1_power"], adam["beta2_power"]), random.getstate(), \
        source.checkpoint_state()


def assert_unchanged(before, after):
    arrays, scalars, rng, source = before
    assert len(arrays) == len(after[0])
    for old, new in zip(arrays, after[0]):
        assert old.dtype == new.dtype and old.shape == new.shape and bool(np.all(old == new))
    assert (scalars, rng, source) == after[1:]


@pytest.fixture(scope="module")
def archive():
    """(the bytes save() writes for a tiny dense run, its checkpoint)."""
    model, optimizer, source = make_run()
    checkpoint = TrainingCheckpoint.capture(model, optimizer, source=source, global_step=2,
                                            metadata={"run": "structure"})
    handle = io.BytesIO()
    checkpoint._write_zip(handle)
    return handle.getvalue(), checkpoint


@pytest.fixture(scope="module")
def live():
    return make_run(seed=9, steps=1)


def refused(data, code, live, match=None):
    before = live_state(*live)
    with pytest.raises(CheckpointError, match=match) as info:
        TrainingCheckpoint.from_bytes(data, "case.riftckpt")
    assert info.value.code == code, str(info.value)
    assert_unchanged(before, live_state(*live))
    return str(info.value)


def headers(data):
    """{"local": [offset], "central": [offset], "end": offset} of a well-formed plain archive."""
    end = len(data) - 22
    count, _, offset = struct.unpack_from("<H2L", data, end + 10)
    central, position = [], offset
    for _ in range(count):
        central.append(position)
        position += 46 + sum(struct.unpack_from("<3H", data, position + 28))
    return {"local": [struct.unpack_from("<L", data, at + 42)[0] for at in central], "central": central,
            "end": end}


def members(data):
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return [(info.filename, zf.read(info)) for info in zf.infolist()]


def written(pairs):
    handle = io.BytesIO()
    checkpoint_zip.write(handle, pairs)
    return handle.getvalue()


# -- the unchanged archive loads; the sweep ------------------------------------------------------


def test_the_archive_loads_from_bytes_and_from_a_file(archive, tmp_path):
    data, checkpoint = archive
    assert TrainingCheckpoint.from_bytes(data).checkpoint_id == checkpoint.checkpoint_id
    checkpoint.save(tmp_path / "run.riftckpt")
    assert (tmp_path / "run.riftckpt").read_bytes() == data
    assert TrainingCheckpoint.load(tmp_path / "run.riftckpt").checkpoint_id == checkpoint.checkpoint_id
    assert written(members(data)) == data  # the member list alone determines every byte


def test_every_one_bit_flip_is_refused_with_a_code_and_live_state_untouched(archive, live):
    data, _ = archive
    assert len(data) < 50_000, len(data)  # a tiny archive (the manifest is most of it), so every byte is swept
    payload = set()
    for at, kind, _, header in checkpoint_zip.layout(
            [checkpoint_zip.Member(checkpoint_zip.encode_name(n), zlib.crc32(b), len(b), len(b))
             for n, b in members(data)]):
        if kind == "local":
            payload.update(range(at + len(header), at + len(header) + struct.unpack_from("<L", header, 18)[0]))
    before = live_state(*live)
    codes, started = {}, time.process_time()  # CPU time: another process's load cannot fail it
    for offset in range(len(data)):
        damaged = bytearray(data)
        damaged[offset] ^= 1 << (offset % 8)
        try:
            TrainingCheckpoint.from_bytes(bytes(damaged), "flipped.riftckpt")
        except CheckpointError as error:
            assert error.code in STRUCTURAL, (offset, error.code, str(error))
            if offset in payload:  # member bytes: the CRC-32 notices every one-bit change
                assert error.code == "corrupt_member", (offset, str(error))
            codes[error.code] = codes.get(error.code, 0) + 1
        else:
            pytest.fail(f"a flip of bit {offset % 8} at offset {offset} loaded")
        if offset % 64 == 0:
            assert_unchanged(before, live_state(*live))
    assert_unchanged(before, live_state(*live))
    assert sum(codes.values()) == len(data)
    assert codes["noncanonical_archive"] > 0 and codes["corrupt_member"] == len(payload), codes
    assert time.process_time() - started < 60


# -- targeted structural edits -------------------------------------------------------------------


def test_a_local_size_field_alone_is_refused_naming_offset_and_field(archive, live):
    data, _ = archive
    at = headers(data)["local"][3]
    damaged = bytearray(data)
    damaged[at + 22] ^= 0x01  # uncompressed size, local header only: what zipfile never read
    message = refused(bytes(damaged), "noncanonical_archive", live)
    assert f"at offset {at + 22}, the local header of member 3" in message
    assert "field 'uncompressed size'" in message


def test_sizes_changed_in_both_headers_are_refused(archive, live):
    data, _ = archive
    h = headers(data)
    damaged = bytearray(data)
    for base, offsets in ((h["local"][2], (18, 22)), (h["central"][2], (20, 24))):
        for field in offsets:
            size = struct.unpack_from("<L", damaged, base + field)[0]
            struct.pack_into("<L", damaged, base + field, size - 4)  # agree with each other, not the file
    message = refused(bytes(damaged), "noncanonical_archive", live)
    assert "the local header of member 3" in message and "field 'signature'" in message


def test_gap_bytes_with_fixed_offsets_are_refused(archive, live):
    data, _ = archive
    h = headers(data)
    gap_at = h["local"][1]  # four bytes between member 0's data and member 1's header
    damaged = bytearray(data[:gap_at] + b"\0\0\0\0" + data[gap_at:])
    for index, at in enumerate(h["central"]):
        if index >= 1:
            struct.pack_into("<L", damaged, at + 4 + 42, h["local"][index] + 4)
    end = h["end"] + 4
    struct.pack_into("<L", damaged, end + 16, struct.unpack_from("<L", damaged, end + 16)[0] + 4)
    with zipfile.ZipFile(io.BytesIO(bytes(damaged))) as zf:  # a ZIP reader takes it
        assert [n for n, _ in members(data)] == zf.namelist() and zf.testzip() is None
    message = refused(bytes(damaged), "noncanonical_archive", live)
    assert f"at offset {gap_at}, the local header of member 1" in message


def test_trailing_bytes_and_an_archive_comment_are_refused(archive, live):
    data, _ = archive
    for extra in (b"\0", b"PK\x05\x06"):
        refused(data + extra, "noncanonical_archive", live, match="no end-of-central-directory record")
    commented = bytearray(data + b"hello")
    struct.pack_into("<H", commented, len(data) - 2, 5)
    with zipfile.ZipFile(io.BytesIO(bytes(commented))) as zf:
        assert zf.comment == b"hello"
    refused(bytes(commented), "noncanonical_archive", live, match="has a comment or trailing bytes")
    refused(data[:-1], "noncanonical_archive", live, match="not a complete ZIP archive")


def test_duplicated_and_reordered_members_are_refused(archive, live):
    data, _ = archive
    pairs = members(data)
    refused(written(pairs + [pairs[4]]), "noncanonical_archive", live, match="duplicate members")
    swapped = pairs[:1] + [pairs[2], pairs[1]] + pairs[3:]
    refused(written(swapped), "noncanonical_archive", live,
            match=f"not in the writer's order: member 1 is '{pairs[2][0]}'")
    refused(written(pairs[1:2] + pairs[:1] + pairs[2:]), "noncanonical_archive", live,
            match="manifest.json is member 1, the writer writes it first")


def test_other_zip_writers_choices_are_refused(archive, live):
    """What another writer (or zipfile's defaults) would choose: times, compression, attributes."""
    data, _ = archive
    pairs = members(data)
    for compression, stamp in ((zipfile.ZIP_STORED, (2026, 1, 2, 3, 4, 6)),
                               (zipfile.ZIP_DEFLATED, (1980, 1, 1, 0, 0, 0))):
        handle = io.BytesIO()
        with zipfile.ZipFile(handle, "w", compression) as zf:
            for name, content in pairs:
                info = zipfile.ZipInfo(name, date_time=stamp)
                info.compress_type, info.create_system, info.external_attr = compression, 3, 0o100644 << 16
                zf.writestr(info, content)
        refused(handle.getvalue(), "noncanonical_archive", live,
                match="field 'modification time'" if compression == zipfile.ZIP_STORED
                else "compression method 8")
    h = headers(data)
    for field, value, name in ((4, 0x031E, "version made by"), (38, 0o100600 << 16, "external attributes"),
                               (36, 1, "internal attributes"), (8, 0x08, "flags")):
        damaged = bytearray(data)
        struct.pack_into("<H" if field != 38 else "<L", damaged, h["central"][5] + field, value)
        refused(bytes(damaged), "noncanonical_archive", live, match=f"field '{name}'")


def test_an_extra_field_in_both_headers_is_refused(archive, live):
    data, _ = archive
    pairs = members(data)
    extra = struct.pack("<HHB4s", 0x5455, 5, 1, b"\0\0\0\0")  # an "extended timestamp", as Info-ZIP adds
    handle = io.BytesIO()
    with zipfile.ZipFile(handle, "w") as zf:
        for name, content in pairs:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.create_system, info.external_attr, info.extra = 3, 0o100644 << 16, extra
            zf.writestr(info, content)
    refused(handle.getvalue(), "noncanonical_archive", live, match="field 'extra field length'")


def test_a_member_that_is_not_where_the_directory_says_is_refused(archive, live):
    data, _ = archive
    h = headers(data)
    damaged = bytearray(data)
    struct.pack_into("<L", damaged, h["central"][2] + 42, h["local"][1])  # points at member 1's header
    refused(bytes(damaged), "noncanonical_archive", live, match="field 'local header offset'")


def test_a_bad_crc_in_both_headers_is_a_corrupt_member(archive, live):
    data, _ = archive
    h = headers(data)
    damaged = bytearray(data)
    for at in (h["local"][1] + 14, h["central"][1] + 16):
        damaged[at] ^= 0x40
    refused(bytes(damaged), "corrupt_member", live, match="is corrupt: Bad CRC-32")


# -- the writer: byte-identical to zipfile's output for save(), ZIP64 included --------------------


def zipfile_writer(pairs):
    """What _write_zip wrote through zipfile before it wrote headers itself."""
    handle = io.BytesIO()
    with zipfile.ZipFile(handle, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, content in pairs:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type, info.create_system, info.external_attr = zipfile.ZIP_STORED, 3, 0o100644 << 16
            with zf.open(info, "w", force_zip64=len(content) >= checkpoint_zip.ZIP64_THRESHOLD) as out:
                out.write(content)
    return handle.getvalue()


def test_the_writer_writes_what_zipfile_wrote(archive):
    data, _ = archive
    assert zipfile_writer(members(data)) == data


@pytest.mark.parametrize("limit, count_limit", [(300, 0xFFFF), (2000, 0xFFFF), (10**9, 5)])
def test_zip64_layouts_match_zipfile_and_load(archive, live, monkeypatch, limit, count_limit):
    """ZIP64 sizes, offsets, end record and locator, at lowered limits so the archive stays small."""
    data, checkpoint = archive
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", limit)
    monkeypatch.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", count_limit)
    monkeypatch.setattr(checkpoint_zip, "ZIP64_LIMIT", limit)
    monkeypatch.setattr(checkpoint_zip, "ZIP64_THRESHOLD", limit + 1)
    monkeypatch.setattr(checkpoint_zip, "ZIP_COUNT_LIMIT", count_limit)
    handle = io.BytesIO()
    checkpoint._write_zip(handle)
    big = handle.getvalue()
    assert big == zipfile_writer(members(data)) and b"PK\x06\x06" in big and big != data
    assert TrainingCheckpoint.from_bytes(big).checkpoint_id == checkpoint.checkpoint_id
    before = live_state(*live)
    tail = len(big) - 22 - (76 if count_limit == 5 or len(big) > limit else 0) - 100
    for offset in [*range(0, len(big), 13), *range(tail, len(big))]:  # the ZIP64 records: every byte
        damaged = bytearray(big)
        damaged[offset] ^= 1 << (offset % 8)
        with pytest.raises(CheckpointError) as info:
            TrainingCheckpoint.from_bytes(bytes(damaged))
        assert info.value.code in STRUCTURAL, (offset, str(info.value))
    assert_unchanged(before, live_state(*live))
