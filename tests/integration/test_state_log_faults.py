"""The state log under real faults, with real processes: a real full disk (a tmpfs
mounted for the test) during appends and in a training loop, then a new process that
resumes; damage in the fsynced bytes of a real run's log, seen by ``snapd status``
run as a command. The in-process half (bit flips, restored in this process) is
tests/test_log_faults.py."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from helpers import fill, put_back_log, train_logged_run
from snapd.errors import InsufficientSpace, SnapshotFailed
from snapd.liveview import collect as watch_collect
from snapd.logwriter import LogWriter
from snapd.progress import expected_steps
from snapd.statelog import (
    HEADER_SIZE,
    LogDamageWarning,
    TornTailWarning,
    list_segments,
    read_records,
    scan_segment,
)
from snapd.store import RunStore
from snapd_client import Client


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB filesystem: writes past it fail with ENOSPC, as on a full disk."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs for a real full disk needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def big_step(i: int) -> dict:
    """Larger than a page, so that on a full disk its write stops part way."""
    return {"kind": "step", "step": i, "samples": list(range(i, i + 3000))}


def test_full_disk_during_append_leaves_no_torn_record_inside_the_log(small_disk):
    run = small_disk / "run"
    w = LogWriter(run, 0, flush_interval=None)
    for i in range(3):
        w.append(big_step(i))
    filler = Path(fill(str(small_disk)))
    size = list_segments(run, 0)[-1].stat().st_size
    with pytest.raises(OSError) as e:
        w.append(big_step(3))
    assert e.value.errno == errno.ENOSPC
    assert list_segments(run, 0)[-1].stat().st_size == size  # cut back, not torn
    filler.unlink()
    for i in (4, 5):
        w.append(big_step(i))
    w.close()
    expect = [big_step(i) for i in (0, 1, 2, 4, 5)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", TornTailWarning)
        warnings.simplefilter("error", LogDamageWarning)
        assert list(read_records(run, 0)) == expect
    with LogWriter(run, 0, flush_interval=None) as w:  # reopening cuts nothing
        w.append(big_step(6))
    assert list(read_records(run, 0)) == expect + [big_step(6)]


RESTORE_SCRIPT = """
import json, sys, torch
from snapd_client import Client
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
client = Client(sys.argv[1], "r", daemon=False)
client.track(model=model, optimizer=opt)
step = client.restore()
client.close()
print(json.dumps({"step": step, "reached": client.recovery.reached}))
"""


def test_full_disk_in_a_training_loop_never_blocks_the_resume(small_disk, tmp_path, warm):
    """log() on a full disk warns and counts; once space is back the run goes on, and a
    new process resumes from the newest committed snapshot; status exits 0."""
    root = str(small_disk / "root")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    client = Client(root, "r", daemon=False, min_free_bytes=0)  # a 1 MiB disk: keep none
    client.track(model=model, optimizer=opt)
    assert client.restore() == 0
    for step in (1, 2):
        client.log(step, loss=0.5, samples=range(3000))
    client.snapshot(2).wait()
    filler = Path(fill(str(small_disk)))
    with pytest.warns(RuntimeWarning, match="state-log record not written"):
        client.log(3, loss=0.5, samples=range(3000))  # the disk is full: never raises
    client.log(4, loss=0.5, samples=range(3000))
    assert client.journal.dropped == 2
    assert client.journal.last_error.errno == errno.ENOSPC
    filler.unlink()
    for step in (5, 6):
        client.log(step, loss=0.5, samples=range(3000))
    client.snapshot(6).wait()
    with pytest.warns(RuntimeWarning, match=r"2 state-log record\(s\) were not written"):
        client.close()  # the total, said once more where the run ends
    script = tmp_path / "restore.py"
    script.write_text(RESTORE_SCRIPT)
    # a child of a warm parent (warm.py): a new process without an import of torch
    out = warm["resumed"].run(str(script), [root], timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {"step": 6, "reached": 6}
    assert "Traceback" not in out.stderr
    status = subprocess.run([sys.executable, "-m", "snapd", "status", root, "--json"],
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    (row,) = json.loads(status.stdout)["runs"]
    assert row["reached"] == 6 and row["committed_step"] == 6 and row["log_damage"] == []


def test_first_snapshot_on_a_full_disk_fails_through_its_handle_not_the_log(small_disk):
    root = str(small_disk / "root")
    client = Client(root, "r", daemon=False)
    client.track(model=torch.nn.Linear(64, 64))
    fill(str(small_disk))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        handle = client.snapshot(1)  # the log cannot even create its segment
        client.log(1, loss=0.5)
    with pytest.raises(SnapshotFailed, match="not enough free space") as failure:
        handle.wait()   # refused by the space check, before a byte is written
    assert isinstance(failure.value.__cause__, InsufficientSpace)
    assert client.journal.dropped >= 2 and client.journal.last_error.errno == errno.ENOSPC
    with pytest.warns(RuntimeWarning, match="were not written"):
        client.close()  # the snapshot's failure was seen once; the log's is summed up


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("damage") / "root")
    train_logged_run(root)
    store = RunStore(root, "r")
    segments = {p.name: p.read_bytes() for p in list_segments(store.path, 0)}
    steps = {r["step"]: r for r in read_records(store.path, 0) if r["kind"] == "step"}
    return root, store, segments, steps


@pytest.mark.filterwarnings("ignore:.*damaged state-log frame:snapd.statelog.LogDamageWarning")
def test_damage_is_warned_with_segment_and_offset_and_moved_aside(trained):
    """Damage before the tail of the newest segment: readers name segment and offset,
    status lists it, and the next writer moves the segment aside and keeps every
    valid record."""
    root, store, segments, steps = trained
    newest = sorted(segments)[-1]
    put_back_log(store.path, segments, newest, segments[newest])
    records, _ = scan_segment(Path(store.path) / "log" / "rank-00000" / newest)
    data = bytearray(segments[newest])
    data[HEADER_SIZE + 20] ^= 0x10  # inside the first frame's payload
    put_back_log(store.path, segments, newest, bytes(data))
    with pytest.warns(LogDamageWarning, match=f"{newest}: damaged state-log frame at "
                      f"offset {HEADER_SIZE}"):
        assert expected_steps(store, 0, 0, 30).keys() == set(range(1, 31)) - {
            r["step"] for r in records[:1] if r["kind"] == "step"}
    table = subprocess.run([sys.executable, "-m", "snapd", "status", root],
                           capture_output=True, text=True, timeout=120)
    assert table.returncode == 0 and "Traceback" not in table.stderr
    assert f"{newest}: damaged state-log frame at offset {HEADER_SIZE}" in table.stderr
    (row,) = watch_collect(root, None)["runs"]
    assert row["error"] is None and row["step"] == 30 and row["log_damage"]
    with pytest.warns(LogDamageWarning, match="moved aside"):
        with LogWriter(store.path, 0, flush_interval=None) as w:
            w.append({"kind": "note"})
    log_dir = Path(store.path) / "log" / "rank-00000"
    assert (log_dir / f"{newest}.damaged-1").read_bytes() == bytes(data)
    assert not (log_dir / newest).exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LogDamageWarning)
        assert list(read_records(store.path, 0))[-len(records):] == records[1:] + [
            {"kind": "note"}]
