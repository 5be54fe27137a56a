"""Coverage-guided fuzzing (atheris, libFuzzer) of both checkpoint loaders; pytest runs it briefly.

Run as `python tests/fuzz/atheris_loaders.py TARGET SCRATCH CORPUS [libFuzzer flags]`:

- riftckpt: each input is a whole `.riftckpt` archive, loaded from SCRATCH/case.riftckpt;
- riftckpt-manifest: each input is manifest.json, stored with the arrays of
  SCRATCH/base.riftckpt; an input that parses as a JSON object gets the checkpoint_id of its
  content first, so mutations reach the checks behind the id;
- kiln: each input is the manifest of SCRATCH/bot-checkpoint-step-00000003.kiln-checkpoint,
  loaded light and full as it is and again canonical with the id of its content.

CheckpointError is the expected answer; any other exception is a crash that libFuzzer
reports with the input. CORPUS holds the seeds (a real archive or manifest). For a long
run pass -runs=-1 -max_total_time=600. KILN_FUZZ_DATA_LIMIT_MB bounds its memory (RLIMIT_DATA).
"""

import hashlib
import io
import json
import os
import resource
import sys
import zipfile

import atheris

LOADERS = ["trainer.jsonio", "trainer.fsio", "trainer.checkpoints", "trainer.checkpoint_format",
           "trainer.checkpoint_manifest", "trainer.checkpoint_archive", "trainer.checkpoint_zip",
           "trainer.runs.checkpoint_dir",
           "trainer.runs.checkpoint_dir_names", "trainer.runs.checkpoint_dir_manifest",
           "trainer.runs.checkpoint_dir_load", "trainer.runs.checkpoint_dir_publish",
           "trainer.runs.checkpoint_dir_registry"]
with atheris.instrument_imports(include=LOADERS):
    from trainer import checkpoint_zip, checkpoints
    from trainer.jsonio import canonical_bytes
    from trainer.runs import checkpoint_dir

KILN_CHECKPOINT = "bot-checkpoint-step-00000003.kiln-checkpoint"


def with_content_id(data: bytes, canonical):
    """`data` re-serialised with the checkpoint_id of its content, or None if it is no such object."""
    try:
        manifest = json.loads(data)
        if not isinstance(manifest, dict) or "checkpoint_id" not in manifest:
            return None
        content = {k: v for k, v in manifest.items() if k != "checkpoint_id"}
        manifest["checkpoint_id"] = hashlib.sha256(canonical(content)).hexdigest()
        return canonical(manifest) + b"\n"
    except Exception:  # the harness's own parse, not the loader's: anything unparseable goes raw
        return None


def riftckpt(scratch):
    path = f"{scratch}/case.riftckpt"

    def one(data: bytes):
        with open(path, "wb") as handle:
            handle.write(data)
        try:
            checkpoints.TrainingCheckpoint.load(path)
        except checkpoints.CheckpointError:
            pass
    return one


def riftckpt_manifest(scratch):
    path = f"{scratch}/case.riftckpt"
    with zipfile.ZipFile(f"{scratch}/base.riftckpt") as base:
        arrays = [(name, base.read(name)) for name in base.namelist() if name != checkpoints.MANIFEST]

    def one(data: bytes):
        manifest = with_content_id(data, canonical_bytes) or data
        buffer = io.BytesIO()  # the writer's canonical structure, so the manifest is what is fuzzed
        checkpoint_zip.write(buffer, [(checkpoints.MANIFEST, manifest), *arrays])
        with open(path, "wb") as handle:
            handle.write(buffer.getvalue())
        try:
            checkpoints.TrainingCheckpoint.load(path)
        except checkpoints.CheckpointError:
            pass
    return one


def kiln(scratch):
    path = f"{scratch}/{KILN_CHECKPOINT}"
    manifest = f"{path}/{checkpoint_dir.MANIFEST}"

    def one(data: bytes):
        for content in (data, with_content_id(data, canonical_bytes)):
            if content is None:
                continue
            with open(manifest, "wb") as handle:
                handle.write(content)
            for full in (False, True):
                try:
                    checkpoint_dir.load_checkpoint(path, full=full)
                except checkpoint_dir.CheckpointError:
                    pass
    return one


def main(argv):
    limit = int(os.environ.get("KILN_FUZZ_DATA_LIMIT_MB", "0")) << 20
    if limit:  # heap and private mappings; a case that needs more fails with MemoryError
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    target, scratch = argv[1], argv[2]
    one = {"riftckpt": riftckpt, "riftckpt-manifest": riftckpt_manifest, "kiln": kiln}[target](scratch)
    atheris.Setup([argv[0]] + argv[3:], one)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
