"""The deadline on restore()'s remote work (snapd/remote/deadline.py): once the caller
went on without it, a pull left running publishes nothing, neither a snapshot nor a
log segment, and leaves no tmp name behind.

The remote is a file:// root filled from a real run by the uploader's own
``upload_snapshot``; its filesystem is substituted by one whose downloads wait at a
gate, so the deadline passes while the pull is half way, exactly.
"""

from __future__ import annotations

import os
import threading
import time

import fsspec
import pytest
import torch

from helpers import file_remote_of
from snapd.errors import InvalidOption, RemoteUnavailable
from snapd.options import Options
from snapd.remote.deadline import Deadline
from snapd.remote.layout import RemoteRoot
from snapd.remote.logsync import pull_log
from snapd.remote.pull import arrived, pull
from snapd.store import RunStore, SnapshotId
from snapd_client import Client

RUN = "gpt"


class GatedFs:
    """The local filesystem, but each download waits until the gate opens."""

    def __init__(self) -> None:
        self.fs = fsspec.filesystem("file")
        self.entered, self.gate = threading.Event(), threading.Event()

    def get_file(self, source, destination, **kwargs):
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return self.fs.get_file(source, destination, **kwargs)

    def __getattr__(self, name):
        return getattr(self.fs, name)


class SlowFs:
    """The local filesystem as a slow link: each download arrives in PIECES pieces,
    PAUSE seconds apart (the slowness is the store's, simulated here)."""

    PIECES, PAUSE = 8, 0.1

    def __init__(self) -> None:
        self.fs = fsspec.filesystem("file")

    def get_file(self, source, destination, **kwargs):
        data = self.fs.cat_file(source)
        step = max(1, -(-len(data) // self.PIECES))
        with open(destination, "wb") as out:
            for at in range(0, len(data), step):
                out.write(data[at:at + step])
                out.flush()
                time.sleep(self.PAUSE)   # the behaviour: a slow store's pace

    def __getattr__(self, name):
        return getattr(self.fs, name)


@pytest.fixture(scope="module")
def remote_dir(tmp_path_factory):
    """A remote root holding snapshots 00000002 and 00000004 of RUN, and its log."""
    base = tmp_path_factory.mktemp("remote-deadline")
    root = str(base / "node-a")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    client = Client(root, RUN, daemon=False)
    client.track(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    client.restore()
    for step in range(1, 5):
        client.log(step, loss=1.0 / step)
        if step % 2 == 0:
            client.snapshot(step).wait()
    client.close()
    file_remote_of(root, RUN, str(base / "remote"))
    return str(base / "remote")


def gated(remote_dir):
    fs = GatedFs()
    return RemoteRoot(f"file://{remote_dir}", fs=fs), fs


def stopped_mid_download(work, fs, deadline):
    """Run ``work`` until its first download waits; stop the deadline there; let the
    download go on; return what ``work`` raised."""
    raised = []

    def body():
        try:
            work()
        except BaseException as e:   # the test looks at it
            raised.append(e)

    thread = threading.Thread(target=body)
    thread.start()
    assert fs.entered.wait(30)
    assert deadline.stop()   # the caller goes on: the work had not ended
    fs.gate.set()
    thread.join(30)
    assert not thread.is_alive()
    return raised


def test_a_pull_stopped_by_its_deadline_commits_nothing(remote_dir, tmp_path):
    remote, fs = gated(remote_dir)
    store = RunStore(str(tmp_path / "node-b"), RUN)
    deadline = Deadline(10.0, remote.url)
    raised = stopped_mid_download(
        lambda: pull(remote, store, "00000004", deadline=deadline), fs, deadline)
    (error,) = raised
    assert isinstance(error, RemoteUnavailable) and error.field == "remote_timeout"
    assert str(error) == (
        f"remote {remote.url}: committing {RUN}/00000004 locally not done: "
        "remote_timeout=10 s passed and the start went on without the remote; raise "
        "remote_timeout if the store is slow rather than silent")
    assert store.committed() == [] and store.read_pointer("LATEST") is None
    assert os.listdir(store.snapshots_path) == []   # its tmp dir removed too


def test_a_log_pull_stopped_by_its_deadline_moves_no_segment_in(remote_dir, tmp_path):
    remote, fs = gated(remote_dir)
    store = RunStore(str(tmp_path / "node-b"), RUN)
    deadline = Deadline(10.0, remote.url)
    (error,) = stopped_mid_download(lambda: pull_log(remote, store, deadline), fs,
                                    deadline)
    assert isinstance(error, RemoteUnavailable) and error.field == "remote_timeout"
    local = os.path.join(store.log_path, "rank-00000")
    assert os.listdir(local) == []   # no segment, no .pull- tmp name


def test_the_same_pull_in_time_commits_and_moves_latest(remote_dir, tmp_path):
    remote, fs = gated(remote_dir)
    fs.gate.set()
    store = RunStore(str(tmp_path / "node-b"), RUN)
    deadline = Deadline(60.0, remote.url)
    outcome = deadline.run(lambda: pull(remote, store, "00000004", deadline=deadline),
                           name="snapd-test-pull")
    assert not outcome.timed_out
    assert outcome.result() == store.snapshot_path(SnapshotId(0, 4))
    assert store.read_pointer("LATEST") == SnapshotId(0, 4)
    assert not deadline.stop()   # it had finished: nothing to stop


def test_a_pull_whose_bytes_keep_arriving_is_not_cut_off(remote_dir, tmp_path):
    """Each file takes 0.8 s to arrive, the deadline is 0.3 s of silence: progress
    (the bytes in the pull's tmp names) pushes it out until the pull commits."""
    remote = RemoteRoot(f"file://{remote_dir}", fs=SlowFs())
    store = RunStore(str(tmp_path / "node-b"), RUN)
    deadline = Deadline(0.3, remote.url)
    began = time.monotonic()
    outcome = deadline.run(
        lambda: pull(remote, store, "00000004", threads=1, deadline=deadline),
        name="snapd-test-slow-pull", progress=lambda: arrived(store))
    assert not outcome.timed_out, "a pull making progress was cut off"
    assert time.monotonic() - began > 1.0   # well past 0.3 s: it was pushed out
    assert outcome.result() == store.snapshot_path(SnapshotId(0, 4))
    assert store.read_pointer("LATEST") == SnapshotId(0, 4)


def test_local_work_after_a_download_is_not_the_stores_silence():
    """Verifying a large download takes what the local disk takes: the deadline is
    suspended during it and starts afresh after (the verification is simulated by a
    pause of three deadlines)."""
    deadline = Deadline(0.2, "s3://bucket/prefix")

    def verify_then_publish():
        with deadline.local_work():
            time.sleep(0.6)   # the behaviour: local work longer than the deadline
        with deadline.publishing("committing"):
            return "published"

    outcome = deadline.run(verify_then_publish, name="snapd-test-local")
    assert not outcome.timed_out and outcome.result() == "published"


def test_run_gives_up_at_the_deadline_and_drops_the_late_outcome():
    release = threading.Event()
    deadline = Deadline(0.2, "s3://bucket/prefix")

    def late():
        release.wait(30)
        with deadline.publishing("committing"):
            return "published"   # never reached: the caller went on

    outcome = deadline.run(late, name="snapd-test-late")
    assert outcome.timed_out and outcome.value is None and outcome.error is None
    release.set()
    for thread in threading.enumerate():
        if thread.name == "snapd-test-late":
            thread.join(30)
    assert outcome.value is None and outcome.error is None   # dropped, not delivered


def test_remote_timeout_is_an_option_with_a_positive_value(monkeypatch):
    assert Options().remote_timeout == 10.0
    monkeypatch.setenv("SNAPD_REMOTE_TIMEOUT", "2.5")
    assert Options.resolve().remote_timeout == 2.5
    for bad in (0, -1.0):
        with pytest.raises(InvalidOption, match=r"remote_timeout=.*: a positive number") \
                as e:
            Options(remote_timeout=bad)
        assert e.value.field == "remote_timeout"
