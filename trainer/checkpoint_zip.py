"""The `.riftckpt` ZIP byte layout in one place: the writer emits exactly it, and the reader refuses any archive whose structure differs from it by one byte.

The layout is the one Python 3.11's zipfile wrote for save() (so archives written before
this module load unchanged): per member a local header with no extra field (a ZIP64 extra
only for members of ZIP64_THRESHOLD bytes or more), the stored bytes, then the central
directory in member order, then (only past zipfile's limits) the ZIP64 end record and
locator, then the end-of-central-directory record with no comment, then nothing. Every
header is a function of the members' names, sizes and CRC-32s, so the reader parses the
central directory, builds the headers the writer would have written and compares bytes.
"""

import struct
import zlib
from dataclasses import dataclass
from typing import NamedTuple

from trainer.checkpoint_format import ZIP64_THRESHOLD, ZIP_TIMESTAMP, CheckpointError

ZIP64_LIMIT = (1 << 31) - 1  # zipfile's: a size or offset above it needs ZIP64 fields
ZIP_COUNT_LIMIT = 0xFFFF  # zipfile's: more members need the ZIP64 end record
STORED, DEFLATED = 0, 8
VERSION, ZIP64_VERSION = 20, 45  # "version needed" (and made by): 2.0, or 4.5 with ZIP64 fields
UNIX = 3  # the "made by" host system, fixed whatever the host
EXTERNAL_ATTRIBUTES = 0o100644 << 16  # a regular file, rw-r--r--
UTF8_NAME = 0x800  # the only flag zipfile sets on a seekable file: a name that is not ASCII
_YEAR, _MONTH, _DAY, _HOUR, _MINUTE, _SECOND = ZIP_TIMESTAMP
DOS_DATE = (_YEAR - 1980) << 9 | _MONTH << 5 | _DAY
DOS_TIME = _HOUR << 11 | _MINUTE << 5 | _SECOND // 2
NONCANONICAL = "noncanonical_archive"

_LOCAL = struct.Struct("<4s2B4HL2L2H")  # 30 bytes, then the name and the extra field
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")  # 46 bytes, then name, extra field and comment
_END = struct.Struct("<4s4H2LH")  # 22 bytes
_END64 = struct.Struct("<4sQ2H2L4Q")  # 56 bytes
_LOCATOR = struct.Struct("<4sLQL")  # 20 bytes
_SIGNATURES = {"local": b"PK\x03\x04", "central": b"PK\x01\x02", "end64": b"PK\x06\x06",
               "locator": b"PK\x06\x07", "end": b"PK\x05\x06"}
_FIELDS = {  # (field, bytes) of each fixed part, in APPNOTE order
    "local": (("signature", 4), ("version needed", 1), ("version needed (high byte)", 1),
              ("flags", 2), ("compression method", 2), ("modification time", 2),
              ("modification date", 2), ("CRC-32", 4), ("compressed size", 4),
              ("uncompressed size", 4), ("file name length", 2), ("extra field length", 2)),
    "central": (("signature", 4), ("version made by", 1), ("made-by host system", 1),
                ("version needed", 1), ("version needed (high byte)", 1), ("flags", 2),
                ("compression method", 2), ("modification time", 2), ("modification date", 2),
                ("CRC-32", 4), ("compressed size", 4), ("uncompressed size", 4),
                ("file name length", 2), ("extra field length", 2), ("file comment length", 2),
                ("disk number start", 2), ("internal attributes", 2), ("external attributes", 4),
                ("local header offset", 4)),
    "end64": (("signature", 4), ("record size", 8), ("version made by", 2), ("version needed", 2),
              ("disk number", 4), ("central directory disk", 4), ("entries on this disk", 8),
              ("entries", 8), ("central directory size", 8), ("central directory offset", 8)),
    "locator": (("signature", 4), ("ZIP64 end record disk", 4), ("ZIP64 end record offset", 8),
                ("disk count", 4)),
    "end": (("signature", 4), ("disk number", 2), ("central directory disk", 2),
            ("entries on this disk", 2), ("entries", 2), ("central directory size", 4),
            ("central directory offset", 4), ("archive comment length", 2)),
}


class Member(NamedTuple):
    """One member as the central directory describes it; the defaults are the writer's."""
    name: bytes  # ASCII, or UTF-8 with the UTF8_NAME flag (zipfile's encoding)
    crc: int
    size: int  # uncompressed bytes
    compressed: int  # bytes in the file
    method: int = STORED
    time: int = DOS_TIME
    date: int = DOS_DATE
    host: int = UNIX
    external: int = EXTERNAL_ATTRIBUTES


_WRITER_FIELDS = Member(b"", 0, 0, 0)[4:]


@dataclass(frozen=True)
class Profile:
    """Which header values are free. WRITER: none (save()'s archives); V1: what the documented
    dense v1 writer (zipfile.writestr, deflated) chose per member: method, time, host, attributes."""
    name: str
    fixed: bool
    local_zip64_factor: float  # a local header carries ZIP64 sizes when size * factor > ZIP64_LIMIT


WRITER = Profile("writer", True, 0.0)  # 0.0: decided by ZIP64_THRESHOLD, as save() forces it
V1 = Profile("v1", False, 1.05)  # zipfile.writestr's own rule


def encode_name(name: str) -> bytes:
    try:
        return name.encode("ascii")
    except UnicodeEncodeError:
        return name.encode("utf-8")


def _local_header(m, zip64, flags):
    extra, size, compressed = b"", m.size, m.compressed
    if zip64:
        extra = struct.pack("<HHQQ", 1, 16, m.size, m.compressed)
        size = compressed = 0xFFFFFFFF
    version = ZIP64_VERSION if zip64 else VERSION
    return _LOCAL.pack(_SIGNATURES["local"], version, 0, flags, m.method, m.time, m.date,
                       m.crc, compressed, size, len(m.name), len(extra)) + m.name + extra


def _central_header(m, offset, local_zip64, flags):
    fields, size, compressed, at = [], m.size, m.compressed, offset
    if m.size > ZIP64_LIMIT or m.compressed > ZIP64_LIMIT:
        fields += [m.size, m.compressed]
        size = compressed = 0xFFFFFFFF
    if offset > ZIP64_LIMIT:
        fields.append(offset)
        at = 0xFFFFFFFF
    extra = struct.pack("<HH" + "Q" * len(fields), 1, 8 * len(fields), *fields) if fields else b""
    version = ZIP64_VERSION if fields or local_zip64 else VERSION
    return _CENTRAL.pack(_SIGNATURES["central"], version, m.host, version, 0, flags, m.method,
                         m.time, m.date, m.crc, compressed, size, len(m.name), len(extra), 0, 0, 0,
                         m.external, at) + m.name + extra


def _end_records(count, size, offset):
    """[(kind, bytes)]: the ZIP64 end record and locator where zipfile writes them, then the end record."""
    records = []
    if count > ZIP_COUNT_LIMIT or offset > ZIP64_LIMIT or size > ZIP64_LIMIT:
        records.append(("end64", _END64.pack(_SIGNATURES["end64"], 44, ZIP64_VERSION, ZIP64_VERSION, 0, 0,
                                             count, count, size, offset)))
        records.append(("locator", _LOCATOR.pack(_SIGNATURES["locator"], 0, offset + size, 1)))
        count, size, offset = min(count, 0xFFFF), min(size, 0xFFFFFFFF), min(offset, 0xFFFFFFFF)
    records.append(("end", _END.pack(_SIGNATURES["end"], 0, 0, count, count, size, offset, 0)))
    return records


def layout(members, profile=WRITER):
    """[(offset, kind, index, header bytes)] of every header, in file order; member i's bytes follow
    its local header. The file ends where the last header ends."""
    if profile.fixed:  # the writer's values for every free field
        members = [m if m[4:] == _WRITER_FIELDS else Member(m.name, m.crc, m.size, m.compressed) for m in members]
    threshold = ZIP64_THRESHOLD if profile.local_zip64_factor == 0.0 else None  # save() forces ZIP64 here
    pack_local, pack_central, limit = _LOCAL.pack, _CENTRAL.pack, ZIP64_LIMIT
    local_signature, central_signature = _SIGNATURES["local"], _SIGNATURES["central"]
    pieces, central, offset = [], [], 0
    for index, m in enumerate(members):
        name, size, compressed = m.name, m.size, m.compressed
        zip64 = size >= threshold if threshold is not None \
            else size * profile.local_zip64_factor > limit  # zipfile.writestr's own rule
        flags = 0 if name.isascii() else UTF8_NAME
        if zip64 or size > limit or compressed > limit or offset > limit:
            header = _local_header(m, zip64, flags)
            central.append(_central_header(m, offset, zip64, flags))
        else:  # the common case, inlined: members number up to 65535 and more
            header = pack_local(local_signature, VERSION, 0, flags, m.method, m.time, m.date, m.crc,
                                compressed, size, len(name), 0) + name
            central.append(pack_central(central_signature, VERSION, m.host, VERSION, 0, flags, m.method,
                                        m.time, m.date, m.crc, compressed, size, len(name), 0, 0, 0, 0,
                                        m.external, offset) + name)
        pieces.append((offset, "local", index, header))
        offset += len(header) + compressed
    directory = offset
    for index, header in enumerate(central):
        pieces.append((offset, "central", index, header))
        offset += len(header)
    for kind, record in _end_records(len(members), offset - directory, directory):
        pieces.append((offset, kind, None, record))
        offset += len(record)
    return pieces


def write(handle, members):
    """Write [(name, bytes-like)] as the canonical archive: headers and data, sequentially."""
    described = [Member(encode_name(name), zlib.crc32(data), len(data), len(data)) for name, data in members]
    data_of = [data for _, data in members]
    for _, kind, index, header in layout(described):
        handle.write(header)
        if kind == "local" and len(data_of[index]):
            handle.write(data_of[index])


# -- reading -------------------------------------------------------------------------------------


def refuse(where, offset, problem):
    raise CheckpointError(f"{where}: not the canonical .riftckpt archive structure: at offset {offset}, "
                          f"{problem}", code=NONCANONICAL)


def parse(data, where):
    """The members the central directory lists, read as leniently as its bounds allow: anything the
    writer would not have written is found by comparing with layout(), not here."""
    n = len(data)
    end = n - _END.size
    if end < 0 or data[end:end + 4] != _SIGNATURES["end"]:
        refuse(where, max(end, 0), "no end-of-central-directory record in the last 22 bytes: the archive "
                                   "is not a complete ZIP archive (truncated or corrupt), or has a comment "
                                   "or trailing bytes")
    _, _, _, _, count, size, offset, _ = _END.unpack_from(data, end)
    locator = end - _LOCATOR.size
    if locator >= 0 and data[locator:locator + 4] == _SIGNATURES["locator"]:
        _, _, record, _ = _LOCATOR.unpack_from(data, locator)
        if record + _END64.size > locator or data[record:record + 4] != _SIGNATURES["end64"]:
            refuse(where, locator, f"the ZIP64 locator points at offset {record}, where no ZIP64 end record is")
        _, _, _, _, _, _, _, count, size, offset = _END64.unpack_from(data, record)
    members, position, unpack, signature = [], offset, _CENTRAL.unpack_from, _SIGNATURES["central"]
    while len(members) < count:
        if position < 0 or position + 46 > n:
            refuse(where, position, f"central directory entry {len(members)} of the {count} the end record "
                                    f"declares is missing")
        (found, _, host, _, _, _, method, time, date, crc, compressed, size, name_length, extra_length,
         comment_length, _, _, external, _) = unpack(data, position)
        if found != signature:
            refuse(where, position, f"central directory entry {len(members)} of the {count} the end record "
                                    f"declares is missing (no signature)")
        start = position + 46
        position = start + name_length + extra_length + comment_length
        if position > n:
            refuse(where, start, f"central directory entry {len(members)} runs past the end of the file")
        name = data[start:start + name_length]
        if extra_length >= 4 and data[start + name_length:start + name_length + 2] == b"\x01\x00":
            extra = data[start + name_length:start + name_length + extra_length]  # ZIP64 sizes, zipfile's order
            declared = int.from_bytes(extra[2:4], "little")
            values = list(struct.unpack_from(f"<{min(declared, extra_length - 4) // 8}Q", extra, 4))
            if size == 0xFFFFFFFF and values:
                size = values.pop(0)
            if compressed == 0xFFFFFFFF and values:
                compressed = values.pop(0)
        members.append(Member(name, crc, size, compressed, method, time, date, host, external))
    return members


def check(data, members, profile, where):
    """Refuse unless `data` is, header for header, what the writer (or the v1 writer) writes for
    `members`; returns where each member's bytes start. The caller checks those against the CRC-32s."""
    try:
        pieces = layout(members, profile)
    except (struct.error, OverflowError):  # a size no header can hold: no writer wrote it
        refuse(where, 0, "a declared size or offset does not fit the ZIP headers")
    tail = next(i for i, piece in enumerate(pieces) if piece[1] != "local")
    for offset, kind, index, expected in pieces[:tail]:
        if data[offset:offset + len(expected)] != expected:
            _describe_mismatch(where, offset, kind, index, expected, bytes(data[offset:offset + len(expected)]),
                               members)
    if data[pieces[tail][0]:] != b"".join(piece[3] for piece in pieces[tail:]):  # one comparison, then detail
        for offset, kind, index, expected in pieces[tail:]:
            found = data[offset:offset + len(expected)]
            if found != expected:
                _describe_mismatch(where, offset, kind, index, expected, bytes(found), members)
    last, _, _, record = pieces[-1]
    if len(data) != last + len(record):
        refuse(where, last + len(record), f"{len(data) - last - len(record)} bytes follow the "
                                          f"end-of-central-directory record")
    return [offset + len(header) for offset, kind, _, header in pieces if kind == "local"]


def _describe_mismatch(where, offset, kind, index, expected, found, members):
    at = next((i for i, (a, b) in enumerate(zip(expected, found)) if a != b), min(len(expected), len(found)))
    what = {"local": "the local header", "central": "the central directory entry",
            "end64": "the ZIP64 end record", "locator": "the ZIP64 end locator",
            "end": "the end-of-central-directory record"}[kind]
    if index is not None:
        what += f" of member {index} ({members[index].name.decode('utf-8', 'replace')!r})"
    if at >= len(found):
        refuse(where, offset + at, f"the file ends inside {what} (after {len(found)} of its {len(expected)} "
                                   f"bytes)")
    fields, start = list(_FIELDS[kind]), 0
    if kind in ("local", "central"):
        fixed = _LOCAL if kind == "local" else _CENTRAL
        name_length, extra_length = struct.unpack_from("<2H", expected, fixed.size - (4 if kind == "local" else 18))
        fields += [("file name", name_length), ("extra field", extra_length)]
    for field, width in fields:
        if start <= at < start + width:
            want = expected[start:start + width]
            got = found[start:start + width]
            if field in ("file name", "extra field", "signature"):
                shown = f"holds {got!r}, the writer writes {want!r}"
            else:
                shown = (f"holds {int.from_bytes(got, 'little')}, the writer writes "
                         f"{int.from_bytes(want, 'little')}")
            refuse(where, offset + at, f"{what}: field '{field}' (at offset {offset + start}) {shown}")
        start += width
    refuse(where, offset + at, f"{what} differs from the writer's")  # unreachable: fields cover it
