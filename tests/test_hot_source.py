"""The client's side of a hot restore that reads the files instead: why, in the words
the resume line quotes (snapd_client/hotrestore.py). A substitute daemon connection and
segments made here; the checksum case runs against the real daemon in
tests/integration/test_resume_messages.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from snapd import protocol as p
from snapd.errors import DaemonUnavailable, SnapdError
from snapd.options import Options
from snapd.reader import SnapshotReader
from snapd.store import RunStore
from snapd.writer import write_snapshot
from snapd_client.hotrestore import HotSource, hot_offer

from helpers import plan_for

ENTRY = {"path": ".w", "dtype": "float32", "shape": [4], "nbytes": 16, "offset": 0}


class Daemon:
    """Answers HotGet with ``reply``, or raises ``error``."""

    def __init__(self, reply=None, error=None):
        self.reply, self.error = reply, error

    def request(self, message):
        assert isinstance(message, p.HotGet) and (message.run, message.rank) == ("r", 0)
        if self.error is not None:
            raise self.error
        return self.reply


def offer(daemon):
    return hot_offer(lambda: daemon, "r", 0)


def test_no_daemon_serving_the_root():
    assert offer(Daemon(error=DaemonUnavailable("no daemon is serving /x"))) == \
        (None, "no daemon is serving the root")


def test_a_daemon_that_does_not_answer():
    assert offer(Daemon(error=SnapdError("timed out"))) == \
        (None, "the daemon did not answer (timed out)")


def test_the_daemons_reason_is_kept_and_an_older_daemons_silence_is_said_plainly():
    why = "the hot copy of 00000004 was released: its client closed cleanly"
    assert offer(Daemon(p.HotReply(reason=why))) == (None, why)
    assert offer(Daemon(p.HotReply())) == \
        (None, "the daemon holds no copy of this run and rank")


@pytest.fixture
def segment():
    name = f"snapd-test-{os.getpid()}-hotsrc"
    path = os.path.join("/dev/shm", name)
    with open(path, "wb") as f:
        f.write(torch.arange(4, dtype=torch.float32).numpy().tobytes())
    yield name
    if os.path.exists(path):
        os.unlink(path)


def reader(name="00000004", **entry):
    return SimpleNamespace(path=f"/root/r/snapshots/{name}",
                           objects={"model": {"tensors": [dict(ENTRY, xxh3=0, **entry)]}})


def source(segment, snapshot="00000004"):
    return HotSource(segment, snapshot, {"objects": [{"name": "model",
                                                      "tensors": [dict(ENTRY)]}]})


def test_a_copy_of_another_snapshot_is_not_read(segment):
    hot = source(segment)
    assert hot(reader("00000006"), "model", {}) is None
    assert hot.why_not_used("00000006") == \
        "the daemon holds step 4, the restore chose step 6"
    hot.close()


def test_a_tensor_that_differs_from_the_manifest_is_named(segment):
    hot = source(segment)
    assert hot(reader(shape=[2], nbytes=8), "model", {}) is None
    assert hot.why_not_used("00000004") == \
        "the hot copy's tensor model/.w does not match the snapshot's manifest"
    hot.close()


def test_a_segment_gone_is_named(segment):
    hot = source(segment)
    os.unlink(os.path.join("/dev/shm", segment))
    assert hot(reader(), "model", {}) is None
    assert hot.why_not_used("00000004") == f"the hot copy's segment {segment} is gone"
    hot.close()


def test_a_checksum_mismatch_is_named(segment):
    hot = source(segment)
    assert hot(reader(), "model", {}) is None   # xxh3 0: not the bytes' digest
    assert hot.why_not_used("00000004") == \
        "a tensor of model in the hot copy did not match its checksum"
    hot.close()


@pytest.mark.parametrize("requires_grad", [False, True])
def test_memory_and_files_turn_the_same_bytes_into_the_same_tensors(tmp_path, segment,
                                                                    requires_grad):
    """One rule for both sources (snapd/reader.py, ``destinations``): a live tensor of
    the saved dtype and shape is read into, unless it requires grad; then it is left
    as it is and the values come in new memory that does not require grad."""
    saved = torch.arange(4, dtype=torch.float32)   # the segment's bytes
    result = write_snapshot(RunStore(str(tmp_path), "r"), plan_for({"w": saved}),
                            Options())
    files = SnapshotReader(result.path)
    hot = source(segment, snapshot=os.path.basename(result.path))
    live = {".w": torch.zeros(4, requires_grad=requires_grad)}
    from_memory = hot(files, "model", live)
    assert hot.used and from_memory is not None
    live_again = {".w": torch.zeros(4, requires_grad=requires_grad)}
    from_files = files.load_objects(["model"], into={"model": live_again})["model"]
    for got, held in ((from_memory[0], live[".w"]), (from_files[0], live_again[".w"])):
        assert torch.equal(got, saved) and not got.requires_grad
        assert (got is held) is not requires_grad
        if requires_grad:
            assert torch.equal(held.detach(), torch.zeros(4))
    hot.close()
