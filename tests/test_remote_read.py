"""The remote tier's reading side on a file:// remote: ``pull`` (snapd/remote/pull.py)
commits a remote snapshot locally bit for bit or not at all, restore() takes a newer
remote commit (snapd_client/fromremote.py), and the replicated log comes down with it.

The remote is filled from real snapshots written in-process, their files copied up
and the record written last, as the daemon's uploader does (docs/remote.md).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import warnings
from contextlib import contextmanager

import pytest
import torch

from snapd import format as fmt
from snapd.errors import CorruptSnapshot, InsufficientSpace, InvalidOption, RemoteUnavailable
from snapd.remote import layout
from snapd.remote.deadline import Deadline
from snapd.remote.layout import RemoteFile, RemoteRoot
from snapd.remote.logsync import pull_log
from snapd.remote.pull import pull
from snapd.store import RunStore, SnapshotId
from snapd_client import Client
from snapd_client.fromremote import RemoteWarning

from helpers import flip_byte, small_model_and_opt, small_train_step

RUN = "gpt"


def train(root, steps=4, snapshot_at=(2, 4), start=None):
    """A run trained in-process: log() every step, a snapshot at ``snapshot_at``."""
    model, opt = small_model_and_opt()
    client = Client(root, RUN, data_version="v1", daemon=False)
    client.track(model=model, optimizer=opt)
    begin = client.restore() if start is None else start
    for step in range(begin + 1, steps + 1):
        client.log(step, loss=small_train_step(model, opt, step))
        if step in snapshot_at:
            client.snapshot(step).wait()
    client.close()
    return model


def copy_up(remote: RemoteRoot, root: str, name: str) -> dict:
    """A local committed snapshot uploaded as the daemon does: files, then the record."""
    local = RunStore(root, RUN).snapshot_path(SnapshotId.parse(name))
    files = []
    for rel in sorted(os.listdir(local)):
        remote.fs.put_file(os.path.join(local, rel), remote.file_path(RUN, name, rel))
        files.append(RemoteFile(rel, os.path.getsize(os.path.join(local, rel))))
    with open(os.path.join(local, fmt.MANIFEST_NAME), "rb") as f:
        record = layout.make_record(RUN, SnapshotId.parse(name), 1, files, f.read())
    remote.write_record(RUN, name, record)
    return record


def log_up(remote: RemoteRoot, root: str) -> None:
    """The run's state log replicated, as the daemon's log sync does."""
    log_dir = os.path.join(root, RUN, "log")
    for rank in os.listdir(log_dir):
        for seg in os.listdir(os.path.join(log_dir, rank)):
            remote.fs.put_file(os.path.join(log_dir, rank, seg),
                               f"{remote.log_path(RUN)}/{rank}/{seg}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A root with snapshots 00000002 and 00000004, its remote holding both and the log."""
    base = tmp_path_factory.mktemp("remote-read")
    root = str(base / "node-a")
    train(root)
    remote = RemoteRoot(f"file://{base}/remote")
    for name in ("00000002", "00000004"):
        copy_up(remote, root, name)
    log_up(remote, root)
    return root, remote


@pytest.fixture
def remote(trained, tmp_path):
    """A private copy of the remote, free to damage."""
    shutil.copytree(trained[1].base, str(tmp_path / "remote"))
    return RemoteRoot(f"file://{tmp_path}/remote")


def leftovers(root: str) -> list:
    snaps = os.path.join(root, RUN, "snapshots")
    return sorted(os.listdir(snaps)) if os.path.isdir(snaps) else []


def remote_file(remote: RemoteRoot, name: str, suffix: str) -> str:
    """The local path of the remote copy of a snapshot's file ending in ``suffix``."""
    folder = remote.snapshot_path(RUN, name)
    return os.path.join(folder, next(n for n in sorted(os.listdir(folder))
                                     if n.endswith(suffix)))


# --- pull ---------------------------------------------------------------------------

def test_pull_commits_the_snapshot_bit_for_bit_and_moves_latest(trained, tmp_path):
    root, remote = trained
    store = RunStore(str(tmp_path / "node-b"), RUN)
    seen = []
    path = pull(remote, store, "00000004", progress=seen.append)
    original = RunStore(root, RUN).snapshot_path(SnapshotId(0, 4))
    assert sorted(os.listdir(path)) == sorted(os.listdir(original))
    for name in os.listdir(original):
        with open(os.path.join(original, name), "rb") as a, \
                open(os.path.join(path, name), "rb") as b:
            assert a.read() == b.read(), name
        assert os.stat(os.path.join(path, name)).st_mode & 0o077 == 0
    assert store.read_pointer("LATEST") == SnapshotId(0, 4)
    assert sum(seen) == remote.read_record(RUN, "00000004")["bytes"]
    assert leftovers(store.root) == ["00000004"]


def test_pulling_an_older_snapshot_leaves_latest_on_the_newer(trained, tmp_path):
    _, remote = trained
    store = RunStore(str(tmp_path / "node-b"), RUN)
    pull(remote, store, "00000004")
    pull(remote, store, "00000002")
    assert store.committed() == [SnapshotId(0, 2), SnapshotId(0, 4)]
    assert store.read_pointer("LATEST") == SnapshotId(0, 4)


class OtherPullFirst(Deadline):
    """No deadline; the other rank of the node pulls the same snapshot and commits
    it just before this pull's own rename."""

    def __init__(self, remote: RemoteRoot, store: RunStore, name: str) -> None:
        super().__init__()
        self.remote, self.store, self.name = remote, store, name
        self.theirs = None

    @contextmanager
    def publishing(self, what: str):
        self.theirs = os.stat(pull(self.remote, self.store, self.name)).st_ino
        with super().publishing(what):
            yield


def test_a_pull_that_finds_the_snapshot_committed_meanwhile_keeps_that_one(trained,
                                                                           tmp_path):
    _, remote = trained
    store = RunStore(str(tmp_path / "node-b"), RUN)
    other = OtherPullFirst(remote, store, "00000004")
    path = pull(remote, store, "00000004", deadline=other)
    assert os.stat(path).st_ino == other.theirs   # theirs kept, ours dropped
    assert leftovers(store.root) == ["00000004"]   # no tmp dir left
    assert store.read_pointer("LATEST") == SnapshotId(0, 4)


def test_a_flipped_byte_in_a_remote_tensor_file_is_refused_naming_it(remote, tmp_path):
    damaged = remote_file(remote, "00000004", fmt.TENSOR_FILE_SUFFIX)
    flip_byte(damaged, os.path.getsize(damaged) - 4096 + 7)   # inside the last chunk
    store = RunStore(str(tmp_path / "node-b"), RUN)
    with pytest.raises(CorruptSnapshot) as e:
        pull(remote, store, "00000004")
    assert e.value.path == f"file://{damaged}", e.value.path
    assert f"file://{damaged}" in str(e.value) and ".tmp-" not in str(e.value)
    assert leftovers(store.root) == []   # no tmp dir, nothing committed
    assert store.read_pointer("LATEST") is None


@pytest.mark.parametrize("how, field", [("missing", "files"), ("longer", "size")])
def test_a_missing_or_resized_remote_file_is_refused_before_downloading(remote, tmp_path,
                                                                        how, field):
    victim = remote_file(remote, "00000004", fmt.TENSOR_FILE_SUFFIX)
    if how == "missing":
        os.unlink(victim)
    else:
        with open(victim, "ab") as f:
            f.write(b"\0")
    store = RunStore(str(tmp_path / "node-b"), RUN)
    with pytest.raises(CorruptSnapshot) as e:
        pull(remote, store, "00000004")
    assert (e.value.path, e.value.field) == (f"file://{victim}", field)
    assert leftovers(store.root) == []


def test_a_manifest_not_matching_the_record_is_refused(remote, tmp_path):
    """The record vouches for the top file's bytes: another snapshot's manifest under
    this name fails the record's top_xxh3."""
    other = remote.file_path(RUN, "00000002", fmt.MANIFEST_NAME)
    mine = remote.file_path(RUN, "00000004", fmt.MANIFEST_NAME)
    record = remote.read_record(RUN, "00000004")
    data = remote.fs.cat_file(other)
    remote.fs.pipe_file(mine, data)
    record["files"] = [[p, len(data) if p == fmt.MANIFEST_NAME else s]
                       for p, s in record["files"]]
    remote.write_record(RUN, "00000004", record)
    store = RunStore(str(tmp_path / "node-b"), RUN)
    with pytest.raises(CorruptSnapshot) as e:
        pull(remote, store, "00000004")
    assert e.value.field == "top_xxh3" and e.value.path == f"file://{mine}"
    assert leftovers(store.root) == []


def test_a_hostile_record_naming_a_path_outside_is_refused(remote, tmp_path):
    record = remote.read_record(RUN, "00000004")
    record["files"].append(["../../../outside", 3])
    remote.write_record(RUN, "00000004", record)
    store = RunStore(str(tmp_path / "node-b"), RUN)
    with pytest.raises(CorruptSnapshot) as e:
        pull(remote, store, "00000004")
    assert e.value.field == "files"
    assert leftovers(store.root) == [] and not os.path.exists(tmp_path / "outside")


def test_a_snapshot_the_disk_cannot_hold_is_refused_before_a_byte(remote, tmp_path):
    store = RunStore(str(tmp_path / "node-b"), RUN)
    with pytest.raises(InsufficientSpace) as e:
        pull(remote, store, "00000004", min_free_bytes=1 << 62)
    assert e.value.field == "min_free_bytes"
    assert leftovers(store.root) == []


def test_a_snapshot_already_committed_locally_is_kept(trained, tmp_path):
    root, remote = trained
    store = RunStore(root, RUN)
    before = os.stat(store.snapshot_path(SnapshotId(0, 4))).st_ino
    assert pull(remote, store, "00000004") == store.snapshot_path(SnapshotId(0, 4))
    assert os.stat(store.snapshot_path(SnapshotId(0, 4))).st_ino == before


def test_the_log_comes_down_only_into_an_empty_local_log(trained, tmp_path):
    root, remote = trained
    store = RunStore(str(tmp_path / "node-b"), RUN)
    assert pull_log(remote, store) == [0]
    ours = os.path.join(store.log_path, "rank-00000")
    theirs = os.path.join(root, RUN, "log", "rank-00000")
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
    for seg in os.listdir(theirs):
        with open(os.path.join(ours, seg), "rb") as a, \
                open(os.path.join(theirs, seg), "rb") as b:
            assert a.read() == b.read()
    assert pull_log(remote, store) == []   # it has segments now: never replaced


# --- restore ------------------------------------------------------------------------

def restore_on(root, url):
    """A fresh process's restore() on ``root`` with the remote tier at ``url``."""
    model, opt = small_model_and_opt()
    client = Client(root, RUN, data_version="v1", daemon=False, remote=url)
    client.track(model=model, optimizer=opt)
    step = client.restore()
    return client, model, opt, step


def test_restore_on_a_new_node_takes_the_newer_remote_snapshot(trained, tmp_path, caplog):
    root, remote = trained
    url = f"file://{remote.base}"
    with caplog.at_level(logging.INFO, logger="snapd_client.client"):
        client, model, _, step = restore_on(str(tmp_path / "node-b"), url)
    assert step == 4 and client.restored_from == "remote"
    assert "resuming from step 4 (remote)" in caplog.text
    original = train(str(tmp_path / "again"), steps=4, snapshot_at=())
    for a, b in zip(model.state_dict().values(), original.state_dict().values()):
        assert torch.equal(a, b)
    # the replicated log came down first: the run's progress is known on the new node
    assert client.recovery.furthest == 4
    client.close()


def test_a_damaged_newest_remote_snapshot_falls_back_to_the_older(remote, tmp_path):
    damaged = remote_file(remote, "00000004", fmt.TENSOR_FILE_SUFFIX)
    flip_byte(damaged, os.path.getsize(damaged) - 4096 + 7)
    url = f"file://{remote.base}"
    with pytest.warns(RemoteWarning, match="00000004 refused"):
        client, _, _, step = restore_on(str(tmp_path / "node-b"), url)
    assert step == 2 and client.restored_from == "remote"
    assert RunStore(str(tmp_path / "node-b"), RUN).committed() == [SnapshotId(0, 2)]
    client.close()


def test_an_unreachable_remote_warns_and_restores_from_the_local_disk(trained, tmp_path):
    root, _ = trained
    local = str(tmp_path / "node-a")
    shutil.copytree(root, local)
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")   # the remote's path runs through a file: listing it fails
    url = f"file://{blocker}/remote"
    with pytest.warns(RemoteWarning, match="not reachable"):
        client, _, _, step = restore_on(local, url)
    assert step == 4 and client.restored_from == "disk"
    client.close()


def test_a_local_snapshot_as_new_as_the_remote_is_not_pulled(trained, tmp_path):
    root, remote = trained
    local = str(tmp_path / "node-a")
    shutil.copytree(root, local)
    url = f"file://{remote.base}"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RemoteWarning)
        client, _, _, step = restore_on(local, url)
    assert step == 4 and client.restored_from == "disk"
    client.close()


def test_the_replay_check_works_after_a_restore_from_the_remote(tmp_path):
    """Node A reached step 5 with its last snapshot at 3, then was lost; node B pulls
    snapshot 3 and the log, recomputes 4 and 5, and the replay check compares them."""
    node_a = str(tmp_path / "node-a")
    train(node_a, steps=5, snapshot_at=(3,))
    remote = RemoteRoot(f"file://{tmp_path}/remote")
    copy_up(remote, node_a, "00000003")
    log_up(remote, node_a)
    url = f"file://{tmp_path}/remote"
    client, model, opt, step = restore_on(str(tmp_path / "node-b"), url)
    assert (step, client.restored_from, client.recovery.furthest) == (3, "remote", 5)
    for s in (4, 5):
        client.log(s, loss=small_train_step(model, opt, s))
    assert client.journal.verdict["verdict"] == "match"
    assert client.journal.verdict["checked"] == 2
    client.close()


def test_a_url_with_credentials_is_refused(tmp_path):
    url = "s3://AKIA:secret@bucket/prefix"
    with pytest.raises(InvalidOption) as e:   # refused by the options, before any I/O
        restore_on(str(tmp_path / "node-b"), url)
    assert "secret" not in str(e.value) and "environment" in str(e.value)


# --- the commands on a remote URL ---------------------------------------------------

def cli(*args: str):
    from click.testing import CliRunner
    from snapd.cli import main
    return CliRunner().invoke(main, list(args), env={"COLUMNS": "200"},
                              catch_exceptions=False)


def test_ls_lists_remote_commits_and_names_an_upload_in_progress(remote):
    remote.fs.pipe_file(remote.file_path(RUN, "00000006", "model.tensors"), b"half")
    url = f"file://{remote.base}"
    result = cli("ls", url, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert [(r["name"], r["step"], r["marks"], r["verified"]) for r in data["snapshots"]] \
        == [("00000002", 2, [], "manifest ok"), ("00000004", 4, ["LATEST"], "manifest ok")]
    assert [w["name"] for w in data["incomplete"]] == ["00000006"]
    table = cli("ls", RUN, "--root", url)
    assert "00000004" in table.output and "upload in progress" in table.output


def test_ls_verify_and_verify_name_a_damaged_remote_snapshot(remote):
    damaged = remote_file(remote, "00000004", fmt.TENSOR_FILE_SUFFIX)
    flip_byte(damaged, os.path.getsize(damaged) - 4096 + 7)
    url = f"file://{remote.base}"
    listed = cli("ls", url, "--verify")
    assert listed.exit_code == 1 and "DAMAGED" in listed.output
    one = cli("verify", f"{url}/{RUN}@2")
    assert one.exit_code == 0 and "ok" in one.output
    every = cli("verify", "--all", "--root", url)
    assert every.exit_code == 1
    assert f"DAMAGED {url}/{RUN}@4" in every.output and damaged in every.output


def test_pull_brings_a_snapshot_down_that_local_commands_then_read(trained, tmp_path):
    _, remote = trained
    url, root = f"file://{remote.base}", str(tmp_path / "node-b")
    result = cli("pull", url, f"{RUN}@2", "--root", root)
    assert result.exit_code == 0, result.output
    assert "verified" in result.output
    assert RunStore(root, RUN).committed() == [SnapshotId(0, 2)]
    assert cli("verify", f"{RUN}@latest", "--root", root).exit_code == 0
    newest = cli("pull", url, RUN, "--root", root)
    assert newest.exit_code == 0 and RunStore(root, RUN).read_pointer("LATEST") == \
        SnapshotId(0, 4)


def test_pull_of_a_damaged_or_absent_remote_snapshot_leaves_nothing(remote, tmp_path):
    damaged = remote_file(remote, "00000004", fmt.TENSOR_FILE_SUFFIX)
    flip_byte(damaged, os.path.getsize(damaged) - 4096 + 7)
    url, root = f"file://{remote.base}", str(tmp_path / "node-b")
    result = cli("pull", url, f"{RUN}@4", "--root", root)
    assert result.exit_code == 1 and damaged in result.output
    assert leftovers(root) == []
    absent = cli("pull", url, f"{RUN}@3", "--root", root)
    assert absent.exit_code == 2 and "00000002, 00000004" in absent.output


def test_inspect_and_export_read_a_remote_snapshot(trained, tmp_path):
    from safetensors.torch import load_file
    root, remote = trained
    url = f"file://{remote.base}"
    info = json.loads(cli("inspect", f"{url}/{RUN}@4", "--json").output)
    assert (info["step"], sorted(info["objects"]), info["files_problem"]) == \
        (4, ["model", "optimizer"], None)
    assert info["path"] == f"file://{remote.snapshot_path(RUN, '00000004')}"
    out = str(tmp_path / "w.safetensors")
    result = cli("export", f"{RUN}@4", "--root", url, "-o", out)
    assert result.exit_code == 0, result.output
    model = train(str(tmp_path / "again"), steps=4, snapshot_at=())
    saved = load_file(out)
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert not any(n.startswith("snapd-pull-") for n in os.listdir(tempfile_dir()))


def tempfile_dir():
    return tempfile.gettempdir()


def test_status_of_a_remote_root_counts_from_the_newest_remote_commit(tmp_path):
    node_a = str(tmp_path / "node-a")
    train(node_a, steps=5, snapshot_at=(3,))
    remote = RemoteRoot(f"file://{tmp_path}/remote")
    copy_up(remote, node_a, "00000003")
    log_up(remote, node_a)
    result = cli("status", f"file://{tmp_path}/remote", "--json")
    assert result.exit_code == 0, result.output
    [row] = json.loads(result.output)["runs"]
    assert (row["run"], row["reached"], row["committed"], row["at_risk"],
            row["remote_commits"]) == (RUN, 5, "00000003", 2, 1)
    assert "00000003" in cli("status", f"file://{tmp_path}/remote").output


def test_a_url_with_credentials_is_refused_by_the_commands():
    result = cli("ls", "s3://AKIA:secret@bucket/prefix")
    assert result.exit_code == 1 and "secret" not in result.output
    assert "environment" in result.output


def test_a_pull_that_loses_the_race_to_another_keeps_the_first(trained, tmp_path):
    """Two pulls of one snapshot (two ranks of a node): the second rename finds the
    first one's directory, keeps it and leaves no tmp dir."""
    _, remote = trained
    store = RunStore(str(tmp_path / "node-b"), RUN)
    first = pull(remote, store, "00000004")
    inode = os.stat(first).st_ino
    os.rename(first, first + "-aside")   # let the second pull run its whole course ...
    real = os.rename

    def rename_after_the_other(src, dst):
        if dst == first:
            real(first + "-aside", first)   # ... and the first win the rename
        return real(src, dst)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "rename", rename_after_the_other)
        assert pull(remote, store, "00000004") == first
    assert os.stat(first).st_ino == inode and leftovers(store.root) == ["00000004"]
