"""Canonical JSON bytes, the ones every manifest, identity and lineage digest is taken over, and one strict
reader for JSON that comes from disk or a request (duplicate keys, NaN/Infinity, overflowing numbers and deep
nesting refused). The I/O floor under both checkpoint formats; it imports nothing of the project."""

from __future__ import annotations

import hashlib
import json
import re

MAX_DEPTH = 64  # nesting; real documents nest a few levels, and json/deepcopy recurse per level
MAX_INT = 2 ** 63 - 1  # integers must fit a signed 64-bit value
MIN_INT = -(2 ** 63)
LINE_END = re.compile(r"\r\n|\r|\n")  # a JSONL line's end
BOM = "\ufeff"  # a UTF-8 file's byte-order mark, once decoded
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # where an unpaired UTF-16 surrogate may be spelt


def canonical_bytes(value, *, ascii_only: bool = True, allow_nan: bool = False) -> bytes:
    """Sorted keys, compact separators; non-ASCII as \\u escapes (or, with ascii_only=False, as UTF-8).

    Each caller's flags are part of the digests it has already written: change none of them."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=ascii_only,
                      allow_nan=allow_nan).encode("ascii" if ascii_only else "utf-8")


def content_sha256(document: dict, omit: str) -> str:
    """SHA-256 hex of the canonical bytes of `document` without its own `omit` field (a self-describing id)."""
    return hashlib.sha256(canonical_bytes({k: v for k, v in document.items() if k != omit})).hexdigest()


def _pairs(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _parse_int(text):
    if len(text.lstrip("-")) > 19:
        raise ValueError(f"integer {text[:24]}... does not fit 64 bits")
    value = int(text)
    if not MIN_INT <= value <= MAX_INT:
        raise ValueError(f"integer {text} does not fit 64 bits")
    return value


def _parse_float(text):
    value = float(text)
    if value in (float("inf"), float("-inf")):  # 1e999 parses to inf
        raise ValueError(f"number {text[:24]} overflows a double")
    return value


def _parse_constant(text):
    raise ValueError(f"{text} is not JSON")


def check_depth(value, max_depth: int = MAX_DEPTH) -> None:
    """ValueError when `value` nests dicts and lists deeper than `max_depth` levels (no recursion)."""
    pending = [(value, 1)]  # a depth the parser survives may still overflow json.dumps or deepcopy
    while pending:
        item, depth = pending.pop()
        if depth > max_depth:
            raise ValueError(f"nested deeper than {max_depth} levels")
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def strict_loads(data: bytes, *, max_depth: int = MAX_DEPTH, bounded_ints: bool = True):
    """Parse UTF-8 JSON strictly; ValueError says what is wrong (duplicate key, NaN, overflow, depth).

    bounded_ints=False accepts integers of any size (a format whose free-form fields always did)."""
    try:
        value = json.loads(data.decode("utf-8"), object_pairs_hook=_pairs,
                           parse_int=_parse_int if bounded_ints else int,
                           parse_float=_parse_float, parse_constant=_parse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ValueError(str(error) or type(error).__name__) from None
    check_depth(value, max_depth)
    return value


def without_bom(text: str) -> str:
    """TEXT without a leading byte-order mark (U+FEFF), which Windows editors write before UTF-8 text."""
    return text[1:] if text.startswith(BOM) else text


def jsonl_lines(text: str):
    """Yields (line number, line) for JSONL TEXT's non-blank lines, numbered from 1 as an editor numbers them. A line
    ends at "\n", "\r\n" or "\r" (no JSON string holds either character raw), as Python's universal newlines: never
    at the U+2028, U+2029, U+0085 ... where str.splitlines() also ends one, which a JSON string may hold unescaped
    (json.dumps(ensure_ascii=False) writes them so). A byte-order mark before the first line is not part of it.
    One line at a time: a list of every line would be a second copy of a file of hundreds of MB beside TEXT."""
    text = without_bom(text)
    start, number = 0, 1
    for end in LINE_END.finditer(text):
        line = text[start:end.start()]
        if line.strip():
            yield number, line
        start, number = end.end(), number + 1
    line = text[start:]
    if line.strip():
        yield number, line


def data_loads(text: str, *, max_depth: int = MAX_DEPTH):
    """json.loads for a line or file of someone's data (training records, prompts, suites): json.JSONDecodeError,
    whose `msg` says what is wrong, also when TEXT nests deeper than MAX_DEPTH levels (the parser's own limit is a
    RecursionError, and json.dumps of the record would recurse past it) or holds an unpaired UTF-16 surrogate escape
    such as "\\ud800" alone, which Python's json reads but is not text: no tokenizer takes it. NaN, duplicate keys
    and the record's shape are left to the reader's own checks."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text, 0) from None
    try:
        check_depth(value, max_depth)
    except ValueError as error:
        raise json.JSONDecodeError(f"nested too deeply ({error})", text, 0) from None
    escape = SURROGATE_ESCAPE.search(text)
    if escape is not None:
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise json.JSONDecodeError("holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff alone), which is "
                                       "not text", text, escape.start()) from None
    return value
