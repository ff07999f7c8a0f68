"""The client's restore reads the remote tier through the Root seam (snapd/roots.py),
as the operator commands do: ``open_root(url, timeout=remote_timeout)``, a StoreRoot,
and its acts (commits, the replicated log, a pull), never the remote layout directly.

The seam is substituted by a StoreRoot that writes down each act it is asked for and
then does it, on a file:// remote filled by the uploader's own ``upload_snapshot``.
The last test gives the many-rank restore a store that accepts connections and never
answers (a listening socket on 127.0.0.1 nothing reads), as the S3 endpoint: the
listing is bounded by ``remote_timeout``.
"""

from __future__ import annotations

import os
import socket
import time
import warnings
from types import SimpleNamespace

import pytest

from helpers import pull_on_rank_threads, file_remote_of, small_model_and_opt, small_train_step
from snapd import roots
from snapd.options import Options
from snapd.store import RunStore, SnapshotId
from snapd_client import Client
from snapd_client.fromremote import RemoteWarning

RUN = "gpt"
NEWEST = SnapshotId(0, 4)


@pytest.fixture(scope="module")
def remote_url(tmp_path_factory):
    """A file:// remote holding snapshots 00000002 and 00000004 of RUN, and its log."""
    base = tmp_path_factory.mktemp("client-remote-root")
    root = str(base / "node-a")
    model, opt = small_model_and_opt()
    client = Client(root, RUN, daemon=False)
    client.track(model=model, optimizer=opt)
    client.restore()
    for step in range(1, 5):
        client.log(step, loss=small_train_step(model, opt, step))
        if step % 2 == 0:
            client.snapshot(step).wait()
    client.close()
    return file_remote_of(root, RUN, str(base / "remote"))


class RecordingRoot(roots.StoreRoot):
    """A StoreRoot that writes down each act it is asked for, then does it."""

    def __init__(self, url, acts, timeout=None):
        super().__init__(url, timeout=timeout)
        self.acts = acts
        acts.append(("open", url, timeout))

    def commits(self, run):
        self.acts.append(("commits", run))
        return super().commits(run)

    def pull_log(self, store, **how):
        self.acts.append(("pull_log", store.run))
        return super().pull_log(store, **how)

    def pull(self, snap, store, **how):
        self.acts.append(("pull", snap.run, snap.name))
        return super().pull(snap, store, **how)


@pytest.fixture
def acts(monkeypatch):
    """Every act on a root the client opens, in order (the seam substituted)."""
    done = []
    monkeypatch.setattr(roots, "open_root",
                        lambda text, *, timeout=None: RecordingRoot(text, done, timeout))
    return done


def test_restore_reads_the_remote_through_a_store_root(remote_url, acts, tmp_path):
    root = str(tmp_path / "node-b")
    model, opt = small_model_and_opt()
    client = Client(root, RUN, daemon=False, remote=remote_url, remote_timeout=7.0)
    client.track(model=model, optimizer=opt)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step = client.restore()
    assert step == 4 and client.restored_from == "remote"
    assert [w for w in seen if issubclass(w.category, RemoteWarning)] == []
    assert acts == [("open", remote_url, 7.0), ("commits", RUN), ("pull_log", RUN),
                    ("pull", RUN, NEWEST.name)]
    store = RunStore(root, RUN)
    assert store.committed() == [NEWEST] and store.read_pointer("LATEST") == NEWEST
    assert os.listdir(os.path.join(store.log_path, "rank-00000"))   # the log came down
    client.close()


def pull_on_two_ranks(root, url, remote_timeout, **options):
    """pull_from_remote on two rank threads sharing ``root``; each rank's result (or
    error) and the FallbackWarnings said."""
    return pull_on_rank_threads(
        [SimpleNamespace(options=Options(remote=url, remote_timeout=remote_timeout,
                                         **options),
                         run=RUN, rank=rank, store=RunStore(root, RUN), _keys=None)
         for rank in range(2)])


def test_many_ranks_read_the_remote_through_a_store_root(remote_url, acts, tmp_path):
    root = str(tmp_path / "node-b")
    out, warned = pull_on_two_ranks(root, remote_url, remote_timeout=7.0)
    assert out == [{NEWEST.name}] * 2 and warned == []
    # Rank 0 lists and, lowest on the shared root, pulls; rank 1 only waits.
    assert acts == [("open", remote_url, 7.0), ("commits", RUN),
                    ("open", remote_url, 7.0), ("pull", RUN, NEWEST.name)]
    assert RunStore(root, RUN).committed() == [NEWEST]


def test_many_ranks_keep_the_clients_free_space_floor(remote_url, tmp_path):
    # A floor no disk has: the pull is refused before a byte is written, as with one
    # rank, and every rank goes on from its local root.
    root = str(tmp_path / "node-b")
    out, warned = pull_on_two_ranks(root, remote_url, remote_timeout=7.0,
                                    min_free_bytes=1 << 60)
    assert out == [set(), set()]
    assert len(warned) == 1 and warned[0].startswith(
        f"remote snapshot {NEWEST.name} could not be pulled (")
    assert "min_free_bytes" in warned[0]
    assert RunStore(root, RUN).committed() == []


@pytest.fixture
def silent_endpoint(monkeypatch):
    """An S3 endpoint that accepts connections (the kernel's backlog) and never
    answers; the AWS variables point at it."""
    pytest.importorskip("s3fs")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_ENDPOINT_URL": "http://127.0.0.1:%d" % sock.getsockname()[1]
                       }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)   # botocore's own retries on
    yield sock
    sock.close()


def test_many_ranks_listing_a_silent_store_is_bounded_by_remote_timeout(silent_endpoint,
                                                                         tmp_path):
    """Unbounded, botocore's read timeout and retries held the listing for minutes."""
    url, timeout = "s3://snapd-test/silent", 1.0
    began = time.monotonic()
    out, warned = pull_on_two_ranks(str(tmp_path / "node-b"), url, remote_timeout=timeout)
    took = time.monotonic() - began
    assert out == [set(), set()]
    assert len(warned) == 2 and warned[0] == warned[1]   # each rank says it once
    assert warned[0].startswith(
        f"restore(): the remote {url} could not be listed (RemoteUnavailable: remote "
        f"{url}: listing the commits of {RUN} failed: ")
    assert warned[0].endswith("; resuming from the local roots only")
    assert took < timeout + 9.0, f"the listing took {took:.1f} s"
