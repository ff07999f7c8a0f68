"""docs/format.md's offset tables are the code's layouts: each row's offset, size and
stated value is read out of bytes the code encodes, and the versions the doc says are
read are the versions the decoders accept. A constant changed without its row, or a
row without its constant, fails here (STYLE.md: "a format spec whose offsets a test
reads")."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, Dict, List

import msgpack
import pytest
import torch
import xxhash

from snapd import format as fmt
from snapd import statelog
from snapd.errors import CorruptSnapshot
from snapd.options import Options
from snapd.store import RunStore
from snapd.writer import write_snapshot

from helpers import plan_for

DOC = Path(__file__).resolve().parent.parent / "docs" / "format.md"
TYPE_BYTES = {"u16": 2, "u32": 4, "u64": 8, "i64": 8}


# --- reading the doc ---------------------------------------------------------------

def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def section(title: str) -> str:
    """The body of the heading whose text is ``title`` (any level), up to the next
    heading of the same or a higher level."""
    lines = doc_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(#+) (.*)$", line)
        if m and m.group(2).strip() == title:
            level, body = len(m.group(1)), []
            for rest in lines[i + 1:]:
                n = re.match(r"^(#+) ", rest)
                if n and len(n.group(1)) <= level:
                    break
                body.append(rest)
            return "\n".join(body)
    raise AssertionError(f"docs/format.md has no heading {title!r}")


def tables(body: str) -> List[List[Dict[str, str]]]:
    """Every markdown table of ``body``: a list of rows, each a map of the lower-cased
    column name to the cell's text."""
    found, block = [], []
    for line in body.splitlines() + [""]:
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.strip().strip("|").split("|")])
            continue
        if len(block) >= 2:
            names = [name.lower() for name in block[0]]
            found.append([dict(zip(names, row)) for row in block[2:]])
        block = []
    return found


def offset_table(title: str) -> List[Dict[str, str]]:
    """The one table of the section with offset, size and field columns."""
    found = [t for t in tables(section(title))
             if t and {"offset", "size", "field"} <= set(t[0])]
    assert len(found) == 1, f"section {title!r}: {len(found)} offset tables, not 1"
    return found[0]


def number(cell: str, n: int = 0) -> int:
    """A table cell's offset or size: a number, or an expression in ``n`` (8+n)."""
    assert re.fullmatch(r"[0-9n+ ]+", cell), f"not an offset or size: {cell!r}"
    return eval(cell, {"__builtins__": {}}, {"n": n})  # digits, n and + only


def backticked_bytes(cell: str) -> bytes:
    """The first `...` of a cell as bytes, ``\\0`` read as a NUL byte."""
    m = re.search(r"`([^`]*)`", cell)
    assert m, f"no `magic` in {cell!r}"
    return m.group(1).replace("\\0", "\0").encode("latin-1")


def stated_value(cell: str) -> int | None:
    """The ``N`` of ``u32 = N`` in a cell, if it states one."""
    m = re.search(r"\bu\d+ = (\d+)\b", cell)
    return int(m.group(1)) if m else None


def stated_read_versions(cell: str) -> List[int]:
    m = re.search(r"\(read: ([\d, ]+)\)", cell)
    assert m, f"the version row does not say which versions are read: {cell!r}"
    return [int(v) for v in m.group(1).split(",")]


def versions_table() -> Dict[int, str]:
    (rows,) = tables(section("Versions"))
    return {int(row["version"]): row["read by this snapd"] for row in rows}


# --- what the code does ------------------------------------------------------------

def accepted_versions(decode: Callable[..., object], data: bytes, at: int,
                      size: int) -> List[int]:
    """The header versions ``decode`` gets past, found by writing each of 0 to
    FORMAT_VERSION + 2 at the documented offset of ``data`` (the payload checksum
    does not cover the header, so only the version check can refuse them)."""
    accepted = []
    for version in range(fmt.FORMAT_VERSION + 3):
        framed = data[:at] + version.to_bytes(size, "little") + data[at + size:]
        try:
            decode(framed, path="under-test")
        except CorruptSnapshot as e:
            if e.field == "version":
                continue
        accepted.append(version)
    return accepted


def check_framed_header(rows: List[Dict[str, str]], data: bytes, magic: bytes,
                        decode: Callable[..., object]) -> List[int]:
    """The rows of a manifest-like header against encoded ``data``; returns the
    versions the version row says are read."""
    assert [r["offset"] for r in rows][0] == "0"
    for row, after in zip(rows, rows[1:]):
        assert number(row["offset"]) + number(row["size"]) == number(after["offset"]), \
            f"rows {row} and {after} are not contiguous"
    by_name = {name: row for row in rows for name in ("magic", "format version", "flags",
                                                      "payload length", "xxh3-64",
                                                      "payload:")
               if row["field"].startswith(name)}
    assert len(by_name) == len(rows) == 6, f"unexpected header rows: {rows}"

    def field(name: str) -> bytes:
        row = by_name[name]
        at = number(row["offset"])
        return data[at:at + number(row["size"])]

    def uint(name: str) -> int:
        width = re.search(r"\b(u\d+)\b", by_name[name]["field"]).group(1)
        assert TYPE_BYTES[width] == number(by_name[name]["size"]), by_name[name]
        return int.from_bytes(field(name), "little")

    assert field("magic") == backticked_bytes(by_name["magic"]["field"]) == magic
    assert uint("format version") == stated_value(by_name["format version"]["field"]) \
        == fmt.FORMAT_VERSION
    assert uint("flags") == stated_value(by_name["flags"]["field"]) == 0
    payload_at = number(by_name["payload:"]["offset"])
    assert payload_at == fmt.HEADER_BYTES and by_name["payload:"]["size"] == "P"
    assert uint("payload length") == len(data) - payload_at
    assert uint("xxh3-64") == xxhash.xxh3_64_intdigest(data[payload_at:])
    assert isinstance(msgpack.unpackb(data[payload_at:]), dict)
    version = by_name["format version"]
    read = stated_read_versions(version["field"])
    assert accepted_versions(decode, data, number(version["offset"]),
                             number(version["size"])) == read
    return read


# --- the snapshot format -----------------------------------------------------------

def test_the_title_names_the_version_written():
    title = doc_text().splitlines()[0]
    assert title == f"# snapd on-disk format, version {fmt.FORMAT_VERSION}"


def test_manifest_header_is_where_the_table_puts_it():
    data = fmt.encode_manifest({"format": fmt.FORMAT_VERSION, "step": 3})
    read = check_framed_header(offset_table("manifest.snapd"), data, fmt.MANIFEST_MAGIC,
                               fmt.decode_manifest)
    assert read == list(fmt.READABLE_VERSIONS)


def test_commit_record_header_is_where_the_table_puts_it():
    data = fmt.encode_commit({"format": fmt.FORMAT_VERSION, "session": "s"})
    read = check_framed_header(offset_table("commit.snapd"), data, fmt.COMMIT_MAGIC,
                               fmt.decode_commit)
    assert read == list(fmt.COMMIT_VERSIONS) == [3, 4, 5]


def test_versions_table_is_what_the_readers_accept():
    table = versions_table()
    read = sorted(v for v, cell in table.items() if cell == "yes")
    assert all(cell in ("yes", "no") for cell in table.values()), table
    assert max(table) == fmt.FORMAT_VERSION
    assert read == list(fmt.READABLE_VERSIONS)
    manifest = fmt.encode_manifest({"format": fmt.FORMAT_VERSION})
    assert accepted_versions(fmt.decode_manifest, manifest, 8, 4) == read


def test_one_validity_rule_per_version_read():
    body = section("Versions")
    rules = [int(v) for v in re.findall(r"^- \*\*Version (\d+)\.\*\*", body, re.M)]
    assert rules == sorted(fmt.READABLE_VERSIONS)
    assert f"above {fmt.FORMAT_VERSION}) is refused" in re.sub(r"\s+", " ", body)


def test_tensor_file_header_is_where_the_table_puts_it():
    rows = offset_table("Tensor files")
    data = fmt.tensor_file_header()
    header = [r for r in rows if r["size"].isdigit()]
    for row, after in zip(rows, rows[1:]):
        if row["size"].isdigit():
            assert number(row["offset"]) + number(row["size"]) == number(after["offset"])
    magic, version, flags, reserved = header
    assert data[0:8] == backticked_bytes(magic["field"]) == fmt.TENSOR_MAGIC
    assert magic["offset"] == "0" and magic["size"] == "8"
    for row, value in ((version, fmt.FORMAT_VERSION), (flags, 0)):
        at, size = number(row["offset"]), number(row["size"])
        assert int.from_bytes(data[at:at + size], "little") == stated_value(row["field"]) \
            == value, row
    at, size = number(reserved["offset"]), number(reserved["size"])
    assert reserved["field"].startswith("reserved, zero") and data[at:at + size] == \
        bytes(size)
    assert at + size == len(data) == fmt.HEADER_BYTES
    padding, chunks = rows[len(header):]
    assert number(padding["offset"]) == fmt.HEADER_BYTES
    assert f"up to byte {fmt.CHUNK_ALIGN}" in padding["field"]
    assert number(chunks["offset"]) == fmt.CHUNK_ALIGN == \
        fmt.chunk_alignment(fmt.FORMAT_VERSION)
    assert "version 1: none" in padding["field"] and fmt.chunk_alignment(1) == 1


def test_a_written_tensor_file_starts_its_chunks_where_the_table_says(tmp_path):
    rows = offset_table("Tensor files")
    result = write_snapshot(RunStore(str(tmp_path), "r"),
                            plan_for({"w": torch.arange(3000.0), "b": torch.ones(5)}),
                            Options(compression="off"))
    manifest = fmt.decode_manifest(
        open(os.path.join(result.path, fmt.MANIFEST_NAME), "rb").read(), path="m")
    obj = manifest["objects"]["model"]
    data = open(os.path.join(result.path, obj["file"]), "rb").read()
    offsets = [c[0] for t in obj["tensors"] for c in t["chunks"]]
    assert offsets[0] == number(rows[-1]["offset"])
    assert all(o % fmt.CHUNK_ALIGN == 0 for o in offsets)
    assert len(data) % fmt.CHUNK_ALIGN == 0
    assert data[:fmt.HEADER_BYTES] == fmt.tensor_file_header()
    assert data[fmt.HEADER_BYTES:offsets[0]] == bytes(offsets[0] - fmt.HEADER_BYTES)


def test_the_docstring_header_table_is_the_docs():
    doc_rows = [(number(r["offset"]), r["size"]) for r in offset_table("manifest.snapd")]
    code_rows = [(int(o), s) for o, s in
                 re.findall(r"^    (\d+)\s+(\d+|P)\s+\S", fmt.__doc__, re.M)]
    assert code_rows == doc_rows
    assert fmt.__doc__.startswith(f"Snapshot format v{fmt.FORMAT_VERSION}:")
    assert f"u32 little-endian ({fmt.FORMAT_VERSION};" in fmt.__doc__


# --- the state log -----------------------------------------------------------------

def log_rows(title: str) -> List[Dict[str, str]]:
    (rows,) = [t for t in tables(section(title))
               if t and {"offset", "size", "type", "field"} <= set(t[0])]
    return rows


def read_field(data: bytes, row: Dict[str, str], n: int = 0) -> int | bytes:
    at, size = number(row["offset"], n), number(row["size"], n)
    raw = data[at:at + size]
    assert len(raw) == size, row
    if row["type"] == "bytes":
        return raw
    assert TYPE_BYTES[row["type"]] == size, row
    return int.from_bytes(raw, "little", signed=row["type"].startswith("i"))


def test_the_log_heading_names_the_log_version():
    assert re.search(rf"^## The state log \(log format version {statelog.VERSION}\)$",
                     doc_text(), re.M)


def test_segment_header_is_where_the_table_puts_it():
    title = f"Segment header ({statelog.HEADER_SIZE} bytes)"
    rows = log_rows(title)
    rank, seq, first_step = 3, 7, -11
    data = statelog.encode_header(rank, seq, first_step)
    fields = {row["field"]: row for row in rows}
    checksum_at = number(fields["header_checksum"]["offset"])
    expected = {
        "magic": backticked_bytes(fields["magic"]["meaning"]),
        "version": statelog.VERSION, "header_size": statelog.HEADER_SIZE,
        "rank": rank, "seq": seq, "first_step": first_step,
        "reserved": bytes(number(fields["reserved"]["size"])),
        "header_checksum": xxhash.xxh32_intdigest(data[:checksum_at]),
    }
    assert list(fields) == list(expected)
    for name, value in expected.items():
        assert read_field(data, fields[name]) == value, name
    assert expected["magic"] == statelog.MAGIC
    assert f"`{statelog.VERSION}`" in fields["version"]["meaning"]
    assert f"`{statelog.HEADER_SIZE}`" in fields["header_size"]["meaning"]
    assert f"bytes 0..{checksum_at}" in fields["header_checksum"]["meaning"]
    last = rows[-1]
    assert number(last["offset"]) + number(last["size"]) == len(data) == \
        statelog.HEADER_SIZE


@pytest.mark.parametrize("payload", [b"", msgpack.packb({"kind": "step", "step": 5})])
def test_frame_is_where_the_table_puts_it(payload):
    rows = log_rows("Frame (n + 12 bytes)")
    n = len(payload)
    seed = statelog.segment_seed(3, 7)
    frame = statelog.encode_frame(payload, seed)
    fields = {row["field"]: row for row in rows}
    footer = fields["footer"]
    footer_bytes = frame[number(footer["offset"], n):]
    expected = {"length": n, "checksum": xxhash.xxh32_intdigest(payload + footer_bytes, seed),
                "payload": payload, "footer": n}
    assert list(fields) == list(expected)
    for name, value in expected.items():
        assert read_field(frame, fields[name], n) == value, name
    assert number(footer["offset"], n) + number(footer["size"], n) == len(frame) == n + 12
    bound = re.search(r"<= (\d+) MiB` \(`MAX_RECORD`\)", fields["length"]["meaning"])
    assert bound and int(bound.group(1)) << 20 == statelog.MAX_RECORD
