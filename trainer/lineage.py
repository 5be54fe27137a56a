"""Request lineage: the hash-chained replay.jsonl and each adapter's lineage.json.

Every admitted request is appended to `replay.jsonl` as one JSON line holding the
previous line's hash, so an edit, deletion, insertion or reordering breaks the chain at
a line `verify_replay` names. `lineage.json` links one adapter's request -> job ->
checkpoints -> final adapter -> evaluations -> promotion, each entry carrying the replay
record hash it came from. Verification checks integrity only: it does not rerun
training or compare losses, tensors or outputs.
"""

import fcntl
import json
import os
from contextlib import contextmanager
from pathlib import Path

from trainer.jsonio import canonical_bytes, content_sha256

REPLAY_SCHEMA = "kiln.replay.v1"
LINEAGE_SCHEMA = "kiln.lineage.v1"
GENESIS = "0" * 64
LINEAGE_STAGES = ("request", "job", "checkpoint", "final_adapter", "evaluation", "promotion")
TAIL_BLOCK = 1 << 16  # bytes read at a time, backwards, to find the newest replay record


class LineageError(ValueError):
    """A broken chain or lineage; `line` is the 1-based line of the first break (or None)."""

    def __init__(self, message, line=None):
        super().__init__(message)
        self.line = line


def record_hash(record: dict) -> str:
    """SHA-256 of the canonical record without its own `hash`."""
    return content_sha256(record, "hash")


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)  # one appender at a time, across processes
        try:
            yield handle
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _last_record(handle, path: Path) -> dict | None:
    """The newest record, read backwards from the end (appending stays cheap as the log grows)."""
    end = handle.seek(0, os.SEEK_END)
    tail, position = b"", end
    while position > 0 and tail.strip().count(b"\n") < 1:
        step = min(TAIL_BLOCK, position)
        position -= step
        handle.seek(position)
        tail = handle.read(step) + tail
    last = tail.strip().rsplit(b"\n", 1)[-1]
    if not last:
        return None
    try:
        record = json.loads(last)
    except ValueError:
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("hash"), str) \
            or not isinstance(record.get("sequence"), int):
        raise LineageError(f"{path}: the last line is not a replay record (a torn or edited write); "
                           "nothing more can be appended until it is repaired; run kiln-replay verify")
    return record


def append_replay(path, kind: str, payload: dict) -> dict:
    """Append one admitted request; returns the record (with its sequence and hash)."""
    path = Path(path)
    with _locked(path) as handle:
        last = _last_record(handle, path)
        record = {"schema": REPLAY_SCHEMA, "sequence": last["sequence"] + 1 if last else 1, "kind": kind,
                  "previous": last["hash"] if last else GENESIS, "payload": payload}
        record["hash"] = record_hash(record)
        handle.seek(0, os.SEEK_END)
        handle.write(canonical_bytes(record) + b"\n")
        handle.flush()
        os.fsync(handle.fileno())
    return record


def verify_replay(path) -> int:
    """Check the whole chain; returns the number of records, or raises LineageError."""
    path = Path(path)
    if not path.is_file():
        raise LineageError(f"{path} does not exist")
    previous, sequence = GENESIS, 0
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                raise LineageError(f"line {number}: empty line inside the chain", number)
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise LineageError(f"line {number}: not JSON ({error.msg})", number) from None
            if not isinstance(record, dict) or record.get("schema") != REPLAY_SCHEMA:
                raise LineageError(f"line {number}: not a {REPLAY_SCHEMA} record", number)
            if record.get("previous") != previous:
                raise LineageError(f"line {number}: previous hash does not match line {number - 1} "
                                   "(a record was removed, inserted or reordered)", number)
            if record.get("sequence") != sequence + 1:
                raise LineageError(f"line {number}: sequence {record.get('sequence')} should be {sequence + 1}",
                                   number)
            if record.get("hash") != record_hash(record):
                raise LineageError(f"line {number}: the record's content does not match its hash "
                                   "(it was edited)", number)
            previous, sequence = record["hash"], sequence + 1
    return sequence


def lineage_path(registry, adapter: str) -> Path:
    return Path(registry) / f"{adapter}.lineage.json"


def record_lineage(registry, adapter: str, stage: str, entry: dict) -> dict:
    """Add one entry (request, job, checkpoint, final_adapter, evaluation, promotion)."""
    if stage not in LINEAGE_STAGES:
        raise ValueError(f"stage must be one of {LINEAGE_STAGES}, got {stage!r}")
    path = lineage_path(registry, adapter)
    with _locked(path.with_suffix(".lock")):
        document = json.loads(path.read_text()) if path.exists() else {
            "schema": LINEAGE_SCHEMA, "adapter": adapter, "entries": []}
        previous = document["entries"][-1]["hash"] if document["entries"] else GENESIS
        item = {"stage": stage, "previous": previous, **entry}
        item["hash"] = record_hash(item)
        document["entries"].append(item)
        staging = path.with_name(f".{path.name}.tmp")
        staging.write_bytes(json.dumps(document, indent=1, sort_keys=True).encode() + b"\n")
        with open(staging, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(staging, path)
    return item


def verify_lineage(registry, adapter: str, replay_path=None) -> int:
    """Check an adapter's lineage chain (and that its request hashes exist in the replay log)."""
    path = lineage_path(registry, adapter)
    if not path.is_file():
        raise LineageError(f"{path} does not exist")
    document = json.loads(path.read_text())
    if document.get("schema") != LINEAGE_SCHEMA or document.get("adapter") != adapter:
        raise LineageError(f"{path}: not the {LINEAGE_SCHEMA} document of {adapter!r}")
    known = None
    if replay_path is not None:
        verify_replay(replay_path)
        with open(replay_path, "rb") as handle:
            known = {json.loads(line)["hash"] for line in handle if line.strip()}
    previous, jobs = GENESIS, set()
    for index, item in enumerate(document["entries"], 1):
        if item.get("previous") != previous:
            raise LineageError(f"{path}: entry {index} does not follow entry {index - 1}", index)
        if item.get("hash") != record_hash(item):
            raise LineageError(f"{path}: entry {index} was edited", index)
        if known is not None and item.get("stage") == "request" and item.get("replay_hash") not in known:
            raise LineageError(f"{path}: entry {index} names a request missing from the replay log "
                               f"({str(item.get('replay_hash'))[:16]}...)", index)
        if item.get("stage") == "job":
            jobs.add(item.get("job_id"))
        elif item.get("job_id") is not None and item.get("stage") in ("checkpoint", "final_adapter") \
                and item["job_id"] not in jobs:
            raise LineageError(f"{path}: entry {index} ({item['stage']}) names job {item['job_id']}, "
                               "which no earlier job entry names", index)
        previous = item["hash"]
    return len(document["entries"])


def main(argv=None) -> int:
    """kiln-replay verify [--replay PATH] [--registry DIR --adapter NAME]"""
    import argparse
    description = ("Verify request-lineage integrity. This checks the hash chain of replay.jsonl and an "
                   "adapter's lineage.json and names the first broken line or entry; it does NOT rerun "
                   "training or compare losses, tensors or outputs.")
    parser = argparse.ArgumentParser(prog="kiln-replay", description=description)
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser("verify", help="check the replay chain (and an adapter's lineage)",
                                 description=description)
    home = Path(os.environ.get("KILN_HOME") or Path.home() / ".kiln").expanduser()
    verify.add_argument("--replay", type=Path, default=home / "replay.jsonl",
                        help="the replay log (default: $KILN_HOME/replay.jsonl)")
    verify.add_argument("--registry", type=Path, default=home / "adapters",
                        help="the adapter registry holding NAME.lineage.json (default: $KILN_HOME/adapters)")
    verify.add_argument("--adapter", metavar="NAME", help="also check this adapter's lineage.json")
    args = parser.parse_args(argv)
    try:
        count = verify_replay(args.replay)
        print(f"{args.replay}: {count} records, chain intact")
        if args.adapter:
            entries = verify_lineage(args.registry, args.adapter, args.replay)
            print(f"{lineage_path(args.registry, args.adapter)}: {entries} entries, chain intact")
    except LineageError as error:
        print(f"kiln-replay: {error}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
