"""The groups a GRPO run reads: their shape and identity, and the sources they come from (inline, a
JSONL file read whole, or a JSONL file streamed from a byte cursor whose consumed lines enter a hash
chain), always in source order, epoch after epoch. `GRPOLoop` is the run's loop state, whose cursor
the sources advance.
"""

import hashlib
import json
import math
from dataclasses import dataclass, field

from trainer.jsonio import data_loads
from trainer.runs.admission import (AdmissionError, FileRecords, RequestError, RunFailed, RunSettings, canonical,
                                    dataset_file, difference, line_place, message_problem, record_place, refuse_record,
                                    sha256_hex, within)

CHAIN_START = hashlib.sha256(b"kiln.grpo.consumed-lines.v1").hexdigest()


# -- groups ---------------------------------------------------------------------------------


def _finite(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def parse_group(record, where) -> dict:
    """The group unchanged after checking its shape; RequestError naming `where` (admission.record_place's place)
    otherwise."""
    if not isinstance(record, dict):
        raise refuse_record(where, "must be an object with prompt or messages, and completions")
    if ("prompt" in record) == ("messages" in record):
        raise refuse_record(where, "needs exactly one of prompt (text) or messages (chat)")
    if "prompt" in record and not isinstance(record["prompt"], str):
        raise refuse_record(where, "prompt must be a string")
    if "messages" in record:
        problem = message_problem(record["messages"]) or (None if record["messages"] else "messages is empty")
        if problem is not None:
            raise refuse_record(where, problem)
    completions = record.get("completions")
    if not isinstance(completions, list) or len(completions) < 2:
        raise refuse_record(where, "completions must be a list of at least two scored completions")
    for index, completion in enumerate(completions):
        here = within(where, f"completions[{index}]")
        if not isinstance(completion, dict) or not isinstance(completion.get("text"), str):
            raise refuse_record(here, "must be an object with a text string")
        if ("reward" in completion) == ("rewards" in completion):
            raise refuse_record(here, "needs exactly one of reward (a number) or rewards ({name: number})")
        if "reward" in completion and not _finite(completion["reward"]):
            raise refuse_record(here, f"reward must be a finite number, got {completion['reward']!r}")
        if "rewards" in completion:
            rewards = completion["rewards"]
            if not isinstance(rewards, dict) or not rewards or not all(
                    v is None or _finite(v) for v in rewards.values()):
                raise refuse_record(here, "rewards must map names to finite numbers (or null)")
    weights = record.get("reward_weights", {})
    if not isinstance(weights, dict) or not all(_finite(v) for v in weights.values()):
        raise refuse_record(where, "reward_weights must map reward names to finite numbers")
    if all("rewards" in c and all(v is None for v in c["rewards"].values()) for c in completions):
        raise refuse_record(where, "no completion is scored (every reward component is null); a group needs at "
                                  "least one reward to compare against")
    try:
        canonical(record)
    except ValueError:
        raise refuse_record(where, "holds a non-finite number") from None
    return record


def group_sha256(record) -> str:
    """A group's identity: SHA-256 of its canonical JSON."""
    return sha256_hex(canonical(record))


# -- sources ----------------------------------------------------------------------------------


def _chain(chain: str, line_sha: str) -> str:
    return hashlib.sha256(bytes.fromhex(chain) + bytes.fromhex(line_sha)).hexdigest()


def _blank(raw: bytes) -> bool:
    return raw.strip() == b""


def _parse_line(raw: bytes, number: int, source: str):
    """The JSON value of 0-based line NUMBER (a byte-order mark before the first line is not part of it)."""
    try:
        return data_loads(raw.decode("utf-8-sig" if number == 0 else "utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RequestError(source, f"line {number + 1} is not UTF-8 JSON: {error}") from None


def scan_stream(path, on_group=None) -> dict:
    """Read a JSONL file once, lazily: its identity (sha256, bytes, lines, groups, line chain)."""
    digest, chain = hashlib.sha256(), CHAIN_START
    lines = groups = size = 0
    with open(path, "rb") as handle:
        for raw in handle:
            digest.update(raw)
            size += len(raw)
            chain = _chain(chain, sha256_hex(raw))
            if not _blank(raw):
                record = parse_group(_parse_line(raw, lines, "dataset_path"), line_place(lines + 1))
                if on_group is not None:
                    on_group(record, line_place(lines + 1))
                groups += 1
            lines += 1
    return {"route": "streamed_jsonl", "sha256": digest.hexdigest(), "bytes": size, "lines": lines,
            "groups": groups, "line_chain_sha256": chain, "order": "source"}


@dataclass
class GRPOLoop:
    epoch: int = 0
    group: int = 0  # next group index within the epoch
    step: int = 0  # committed optimizer steps
    iteration: int = 0  # iterations done on the pending batch (0: none pending)
    line: int = 0  # streamed: next physical line (0-based) and its byte offset
    byte: int = 0
    chain: str = CHAIN_START  # streamed: chain hash of the lines consumed this epoch
    chain_lines: int = 0
    losses: list = field(default_factory=list)
    audits: list = field(default_factory=list)
    plans: list = field(default_factory=list)
    totals: dict = field(default_factory=lambda: {
        "steps": 0, "tokens": 0, "completions": 0, "clipped_low": 0, "clipped_high": 0,
        "ratio_sum": 0.0, "kl_sum": 0.0, "reward_sum": 0.0})
    refreshes: list = field(default_factory=list)  # steps after which the EMA reference was refreshed
    pending: list | None = None  # group refs of the batch still being iterated

    def cursor(self) -> dict:
        return {"epoch": self.epoch, "group": self.group, "line": self.line, "byte": self.byte,
                "chain": self.chain, "chain_lines": self.chain_lines}


class MemorySource:
    """Inline groups or a JSONL file read whole."""

    def __init__(self, records):
        self.records = records
        self.hashes = [group_sha256(r) for r in records]

    @property
    def count(self):
        return len(self.records)

    def read(self, loop: GRPOLoop, count: int):
        out = []
        while len(out) < count and loop.group < self.count:
            i = loop.group
            out.append(({"index": i, "sha256": self.hashes[i]}, self.records[i]))
            loop.group += 1
        if loop.group >= self.count:
            loop.epoch += 1
            loop.group = 0
        return out

    def reread(self, ref):
        record = self.records[ref["index"]]
        if self.hashes[ref["index"]] != ref["sha256"]:
            raise AdmissionError("source_changed", f"group {ref['index']} is not the group the checkpoint "
                                 "was iterating", [difference(f"dataset.group[{ref['index']}]", ref["sha256"],
                                                              self.hashes[ref["index"]])])
        return record

    def peek(self, loop: GRPOLoop):
        return self.hashes[loop.group] if loop.group < self.count else None

    def close(self):
        pass


class StreamSource:
    """A JSONL file read lazily from a byte cursor; each consumed line's hash enters a chain."""

    def __init__(self, path, identity: dict):
        self.path = path
        self.identity = identity
        self.handle = open(path, "rb")

    def _consume(self, loop: GRPOLoop):
        """The next physical line at the cursor, or None at the end of the file."""
        self.handle.seek(loop.byte)
        raw = self.handle.readline()
        if not raw:
            return None
        offset, number = loop.byte, loop.line
        line_sha = sha256_hex(raw)
        loop.byte += len(raw)
        loop.line += 1
        loop.chain = _chain(loop.chain, line_sha)
        loop.chain_lines += 1
        return number, offset, raw, line_sha

    def _record(self, raw, number):
        try:
            return parse_group(_parse_line(raw, number, "dataset_path"), line_place(number + 1))
        except RequestError as error:
            raise RunFailed("source_changed", f"{self.path} changed while streaming: {error}") from None

    def read(self, loop: GRPOLoop, count: int):
        out = []
        while len(out) < count and loop.group < self.identity["groups"]:
            consumed = self._consume(loop)
            if consumed is None:
                raise RunFailed("source_changed", f"{self.path} ended before group {loop.group}; it changed "
                                                  "while streaming")
            number, offset, raw, line_sha = consumed
            if _blank(raw):
                continue
            record = self._record(raw, number)
            out.append(({"index": loop.group, "sha256": group_sha256(record), "line": number, "offset": offset,
                         "length": len(raw), "line_sha256": line_sha}, record))
            loop.group += 1
        if loop.group >= self.identity["groups"]:
            while self._consume(loop) is not None:  # trailing blank lines belong to this epoch
                pass
            if loop.chain != self.identity["line_chain_sha256"] or loop.chain_lines != self.identity["lines"]:
                raise RunFailed("source_changed", f"{self.path} changed while streaming: the lines read in "
                                                  f"epoch {loop.epoch} do not hash to the admitted file")
            loop.epoch += 1
            loop.group = loop.line = loop.byte = loop.chain_lines = 0
            loop.chain = CHAIN_START
        return out

    def reread(self, ref):
        self.handle.seek(ref["offset"])
        raw = self.handle.read(ref["length"])
        if sha256_hex(raw) != ref["line_sha256"]:
            raise AdmissionError("source_changed", f"line {ref['line'] + 1} of {self.path} changed since the "
                                 "checkpoint", [difference(f"dataset.line[{ref['line'] + 1}]", ref["line_sha256"],
                                                           sha256_hex(raw))])
        return self._record(raw, ref["line"])

    def peek(self, loop: GRPOLoop):
        probe = GRPOLoop(byte=loop.byte, line=loop.line)
        while (consumed := self._consume(probe)) is not None:
            if not _blank(consumed[2]):
                return group_sha256(self._record(consumed[2], consumed[0]))
        return None

    def close(self):
        self.handle.close()


def verify_stream_prefix(path, cursor: dict, plans=()) -> None:
    """Re-read the lines before the byte cursor; AdmissionError("source_changed") unless they hash the same."""
    chain, lines, position = CHAIN_START, 0, 0
    seen = {}
    with open(path, "rb") as handle:
        while position < cursor["byte"]:
            raw = handle.readline()
            if not raw:
                break
            line_sha = sha256_hex(raw)
            seen[lines] = line_sha
            chain = _chain(chain, line_sha)
            position += len(raw)
            lines += 1
    if (chain, lines, position) == (cursor["chain"], cursor["chain_lines"], cursor["byte"]):
        return
    differences = [difference("dataset.consumed_lines", {"lines": cursor["chain_lines"], "byte": cursor["byte"],
                                                         "chain_sha256": cursor["chain"]},
                              {"lines": lines, "byte": position, "chain_sha256": chain})]
    for plan in plans:
        if plan["epoch"] != cursor["epoch"]:
            continue
        for ref in plan["groups"]:
            if seen.get(ref["line"]) != ref["line_sha256"]:
                differences.append(difference(f"dataset.line[{ref['line'] + 1}]", ref["line_sha256"],
                                              seen.get(ref["line"])))
                break
        if len(differences) > 1:
            break
    raise AdmissionError("source_changed", f"{path} changed: the {cursor['chain_lines']} line(s) the checkpoint "
                         "consumed this epoch no longer hash the same; restore the original file or start a "
                         "new run", differences)


def read_groups(request: dict, config: dict, settings: RunSettings, check=None):
    """(kind, dataset identity, records or None, path or None); `check(record, where)` validates each group."""
    if config["streaming"]:
        path = dataset_file(request, settings)
        return "streamed_jsonl", scan_stream(path, check), None, path
    if request.get("dataset_path") is not None:
        path = dataset_file(request, settings)
        raw = path.read_bytes()
        records, lines = [], []
        for number, line in enumerate(raw.split(b"\n")):
            if not _blank(line):
                records.append(parse_group(_parse_line(line, number, "dataset_path"), line_place(number + 1)))
                lines.append(number + 1)
        records = FileRecords(records, lines)
        kind = "file"
    else:
        groups = request["groups"]
        if not isinstance(groups, list):
            raise RequestError("groups", "must be a list of groups")
        records = [parse_group(g, record_place(groups, i, "groups")) for i, g in enumerate(groups)]
        raw = b"".join(canonical(r) + b"\n" for r in records)
        kind, path = "inline", None
    if check is not None:
        for index, record in enumerate(records):
            check(record, record_place(records, index, "groups"))
    identity = {"route": kind, "sha256": sha256_hex(raw), "bytes": len(raw), "groups": len(records),
                "order": "source"}
    return kind, identity, records, path
