"""The state log under faults never blocks a resume: bit flips in the fsynced bytes
and headers of a log a real Client wrote, each followed by a restore in this process;
segments made owner-only, and by restore, not by the first record. The faults that
need real processes (a real full disk, a new process resuming, ``snapd status`` as a
command) are tests/integration/test_state_log_faults.py."""

from __future__ import annotations

import json
import os
import stat
import warnings

import pytest
import torch
from click.testing import CliRunner

from helpers import put_back_log, train_logged_run
from snapd.cli import main
from snapd.logwriter import LogWriter
from snapd.progress import expected_steps
from snapd.statelog import (
    HEADER_SIZE,
    LogDamageWarning,
    TornTailWarning,
    list_segments,
    read_records,
)
from snapd.store import RunStore
from snapd_client import Client

LOG_WARNINGS = (LogDamageWarning, TornTailWarning)


def test_log_segments_are_created_owner_only(tmp_path):
    old = os.umask(0o022)
    try:
        with LogWriter(tmp_path, 0, segment_bytes=1024, flush_interval=None) as w:
            for i in range(40):
                w.append({"kind": "step", "step": i, "pad": "x" * 100})
    finally:
        os.umask(old)
    modes = {stat.S_IMODE(p.stat().st_mode) for p in list_segments(tmp_path, 0)}
    assert modes == {0o600}


# --- bit flips in a real run's log ----------------------------------------------------

def restore_step(root: str) -> int:
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 2)
    client = Client(root, "r", daemon=False)
    client.track(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        return client.restore()
    finally:
        client.close()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("flips") / "root")
    train_logged_run(root)
    store = RunStore(root, "r")
    segments = {p.name: p.read_bytes() for p in list_segments(store.path, 0)}
    steps = {r["step"]: r for r in read_records(store.path, 0) if r["kind"] == "step"}
    return root, store, segments, steps


# The header's fields by their first byte (snapd/statelog.py's table): magic, version,
# header size, rank, seq, first_step, reserved, checksum.
HEADER_FIELDS = (0, 8, 10, 12, 16, 24, 32, 44)


def frames(raw: bytes) -> list:
    """(offset, payload length) of every frame of a segment, walked by its lengths."""
    found, at = [], HEADER_SIZE
    while at + 12 <= len(raw):
        n = int.from_bytes(raw[at:at + 4], "little")
        found.append((at, n))
        at += n + 12
    return found


def frame_bits(raw: bytes, which: list, length_bit: int) -> list:
    """One flipped bit in each part of the frames ``which`` (indices): the length
    (bit ``length_bit`` of it), the checksum, the payload's middle byte, the footer."""
    found = frames(raw)
    bits = []
    for at, n in (found[i] for i in which):
        bits += [at * 8 + length_bit, (at + 4) * 8 + 3, (at + 8 + n // 2) * 8 + 5,
                 (at + 8 + n) * 8 + 1]
    return bits


def flip_positions(segments: dict) -> list:
    """(segment, bit) of each flip.

    Why these cover the ground of flipping every bit: the reader's verdict depends on
    the part a flip lands in, not on which bit of it. A header is checked field by
    field: its magic, its version, then its xxh32, which a flip anywhere else fails
    first (the later fields are checked only in a header whose checksum holds). So
    each field is flipped once in the newest segment (its last byte: the one the
    writer reopens, and moves aside when its header is bad) and once in an older one
    (its first or second byte: readers skip it); the bits taken vary. A frame is
    checked by its length, its footer's copy of it and its checksum: every segment
    gets a flip in each of those parts and in the payload, of its first frame, a
    middle one or its last (the sync mark sealing it), in turn; the newest all three.
    The length flips take bit 0 (a length one off), bit 12 (past a page) and bit 31
    (over MAX_RECORD) in turn."""
    names = sorted(segments)
    field_ends = HEADER_FIELDS[1:] + (HEADER_SIZE,)
    flips = [(names[-1], (end - 1) * 8 + (i + 3) % 8) for i, end in enumerate(field_ends)]
    older = names[:-1]
    flips += [(older[i % len(older)], (at + i % 2) * 8 + i % 8)
              for i, at in enumerate(HEADER_FIELDS)]
    for i, name in enumerate(names):
        count = len(frames(segments[name]))
        which = [0, count // 2, count - 1] if name == names[-1] else \
            [(0, count // 2, count - 1)[i % 3]]
        flips += [(name, bit) for bit in
                  frame_bits(segments[name], which, (0, 12, 31)[i % 3])]
    return flips


def test_bit_flips_in_fsynced_bytes_and_headers_never_block_the_resume(trained):
    """Every flip: the restore resumes from the newest committed snapshot (step 30),
    the replay records it would check are the original ones (at most the damaged
    segment's lost), and status answers with exit code 0."""
    root, store, segments, steps = trained
    assert len(segments) >= 3, "the run must span several segments"
    for name, bit in flip_positions(segments):
        data = bytearray(segments[name])
        data[bit // 8] ^= 1 << (bit % 8)
        put_back_log(store.path, segments, name, bytes(data))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for step in (20, 30):  # a restore cut from the expected steps' view
                replay = expected_steps(store, 0, step - 10, step)
                assert all(steps[s] == r for s, r in replay.items()), (name, bit)
            assert restore_step(root) == 30, (name, bit)
            rows = CliRunner().invoke(main, ["status", root, "--json"])
        assert rows.exit_code == 0, (name, bit, rows.output)
        (row,) = json.loads(rows.output)["runs"]
        assert row["latest"] == "00000030" and row["committed_step"] == 30
        if bit < HEADER_SIZE * 8:  # a bad header: the segment is skipped, with a warning
            assert any(name in str(w.message) for w in seen if w.category in LOG_WARNINGS)


def test_a_fresh_runs_log_segment_is_made_by_restore_not_by_the_first_record(tmp_path):
    """The segment's fsyncs belong to the trainer's setup: restore() of a fresh run makes
    it, and the first record only writes."""
    import torch
    from snapd_client import Client
    from snapd import statelog
    c = Client(str(tmp_path), "fresh", daemon=False)
    c.track(model=torch.nn.Linear(2, 2))
    assert statelog.list_segments(c.store.path, 0) == []
    assert c.restore() == 0
    [segment] = statelog.list_segments(c.store.path, 0)
    size = os.path.getsize(segment)
    writer = c.journal.writer
    calls = []
    writer._fsync = lambda fd: calls.append(fd)
    c.log(1, loss=1.0)
    assert calls == [] and os.path.getsize(segment) > size
    assert statelog.list_segments(c.store.path, 0) == [segment]
    c.close()
