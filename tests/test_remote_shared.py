"""The remote tier with shared files (format v4): a snapshot whose tensors read an
earlier snapshot's tensor file carries that file to ``<url>/<run>/shared/<S>/<file>``
once, lists it in its record, brings it down on pull to ``<run>/shared/<S>/<file>``,
and remote retention keeps it while a kept record lists it (snapd/remote/*)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from snapd import format as fmt
from snapd import sharing
from snapd.errors import CorruptSnapshot
from snapd.options import Options
from snapd.plan import ObjectPlan, SnapshotPlan, TensorSource
from snapd.reader import SnapshotReader
from snapd.remote import retention
from snapd.remote.layout import RemoteRoot, decode_record, encode_record, record_shared
from snapd.remote.pull import pull
from snapd.remote.upload import upload_snapshot
from snapd.remote.uploader import pinned
from snapd.store import RunStore
from snapd.writer import write_snapshot
from snapd_client.capture import tensor_bytes
from snapd_client.state import flatten

from helpers import record_puts

RUN = "r"
BASE = {"w1": torch.arange(4096, dtype=torch.float32), "w2": torch.ones(64, 64)}


@pytest.fixture
def store(tmp_path):
    return RunStore(str(tmp_path / "root"), RUN)


@pytest.fixture
def remote(tmp_path):
    from fsspec.implementations.local import LocalFileSystem
    fs = LocalFileSystem(auto_mkdir=True, skip_instance_cache=True)
    return RemoteRoot(f"file://{tmp_path}/remote", fs=fs)


def _object(name, state, kind="x.Y"):
    flat = flatten(state, name)
    tensors = [TensorSource(p, str(t.dtype)[6:], list(t.shape), tensor_bytes(t))
               for p, t in zip(flat.paths, flat.tensors)]
    return ObjectPlan(name, kind, flat.skeleton, tensors)


def _plan(step, base):
    adapter = {"a": torch.full((16,), float(step))}
    return SnapshotPlan(RUN, step, {"id": 0, "mode": "fresh", "parent": None},
                        [_object("base", base, "torch.nn.modules.linear.Linear"),
                         _object("adapter", adapter)],
                        {"python": b"s"})


def write(store, step, base=None):
    """A snapshot of a frozen base and a small adapter; every byte its own unless the
    writer finds them in the newest committed snapshot (a base unchanged)."""
    return write_snapshot(store, _plan(step, BASE if base is None else base),
                          Options()).sid


def write_sharing(store, step, home, tmp_path):
    """A snapshot whose base reads ``home``'s base file (``src``), as the writer makes
    one: written whole aside, its base entries turned into ``src`` form, its own base
    file dropped, committed by renaming a tmp dir into ``snapshots/``."""
    aside = RunStore(str(tmp_path / f"aside-{step}"), RUN)
    sid = write(aside, step)
    tmp = os.path.join(store.snapshots_path, f".tmp-hand-{sid.name}")
    shutil.copytree(aside.snapshot_path(sid), tmp)
    path = os.path.join(tmp, fmt.MANIFEST_NAME)
    with open(path, "rb") as f:
        manifest = fmt.decode_manifest(f.read(), path=path)
    base = manifest["objects"]["base"]
    own = base["file"]
    size = os.path.getsize(os.path.join(store.snapshot_path(home), own))
    manifest["shared"] = [{"snapshot": home.name, "file": own, "size": size, "format": fmt.FORMAT_VERSION}]
    for t in base["tensors"]:
        t["src"] = 0
    base["file"] = None
    del manifest["files"][own]
    os.unlink(os.path.join(tmp, own))
    with open(path, "wb") as f:
        f.write(fmt.encode_manifest(manifest))
    os.rename(tmp, store.snapshot_path(sid))
    return sid, own, size


def retire(store, sid, file):
    """Local retention deleting ``sid`` while a later snapshot reads ``file`` of it:
    the file hard-linked to ``shared/<sid>/`` first, then the snapshot removed."""
    shared = sharing.shared_path(store.path, sid.name, file)
    os.makedirs(os.path.dirname(shared), exist_ok=True)
    os.link(os.path.join(store.snapshot_path(sid), file), shared)
    shutil.rmtree(store.snapshot_path(sid))


def shared_puts(remote):
    """Every remote write under ``shared/``, in order."""
    order, base = [], remote.run_path(RUN) + "/"
    put = remote.fs.put_file
    remote.fs.put_file = lambda src, dst, **k: (order.append(dst[len(base):]),
                                                put(src, dst, **k))
    return order




def loaded(reader, obj):
    """An object's tensors by path, read through the reader (shared files included)."""
    return dict(zip([t["path"] for t in reader.objects[obj]["tensors"]],
                    reader.load_object(obj)))


# --- upload ---------------------------------------------------------------------------

def test_upload_puts_the_shared_file_once_before_the_manifest_and_lists_it(store, remote,
                                                                           tmp_path):
    s1 = write(store, 1)
    s2, own, size = write_sharing(store, 2, s1, tmp_path)
    s3, _, _ = write_sharing(store, 3, s1, tmp_path)
    upload_snapshot(remote, store, s1.name)
    order = record_puts(remote, RUN)
    record = upload_snapshot(remote, store, s2.name)
    shared = f"shared/{s1.name}/{own}"
    assert order.count(shared) == 1
    assert order.index(shared) < order.index(f"snapshots/{s2.name}/{fmt.MANIFEST_NAME}")
    assert order[-1] == f"committed/{s2.name}.snapd"
    assert record["shared"] == [{"snapshot": s1.name, "file": own, "size": size}]
    assert remote.read_record(RUN, s2.name)["shared"] == record["shared"]
    assert own not in {p for p, _ in record["files"]}
    with open(os.path.join(store.snapshot_path(s1), own), "rb") as f:
        assert remote.fs.cat_file(remote.shared_path(RUN, s1.name, own)) == f.read()
    order.clear()
    upload_snapshot(remote, store, s3.name)   # the base is up: not sent again
    assert shared not in order and order[-1] == f"committed/{s3.name}.snapd"
    assert record_shared(remote.read_record(RUN, s3.name))[0].key == (s1.name, own)


def test_upload_reads_a_shared_file_kept_in_shared_after_its_snapshot_is_gone(
        store, remote, tmp_path):
    s1 = write(store, 1)
    s2, own, size = write_sharing(store, 2, s1, tmp_path)
    retire(store, s1, own)
    upload_snapshot(remote, store, s2.name)
    assert remote.shared_files(RUN) == {(s1.name, own): size}


def test_upload_of_a_shared_file_found_nowhere_fails_naming_both_places(store, remote,
                                                                       tmp_path):
    s1 = write(store, 1)
    s2, own, _ = write_sharing(store, 2, s1, tmp_path)
    shutil.rmtree(store.snapshot_path(s1))
    with pytest.raises(CorruptSnapshot) as e:
        upload_snapshot(remote, store, s2.name)
    assert "shared" in str(e.value) and s1.name in str(e.value)
    assert remote.commits(RUN) == []


def test_the_uploader_pins_shared_files_against_local_retention(store, remote, tmp_path):
    s1 = write(store, 1)
    s2, own, size = write_sharing(store, 2, s1, tmp_path)
    with pinned(store, s2) as pin:
        shutil.rmtree(store.snapshot_path(s1))   # retention and its sweep, meanwhile
        upload_snapshot(remote, pin, s2.name)
    assert remote.shared_files(RUN) == {(s1.name, own): size}


# --- the record -----------------------------------------------------------------------

def _record(**shared_entry):
    entry = {"snapshot": "00000001", "file": "base.tensors", "size": 10}
    entry.update(shared_entry)
    return {"run": RUN, "name": "00000002", "step": 2, "lineage": 0, "world_size": 1,
            "files": [["manifest.snapd", 5]], "bytes": 5, "top": "manifest.snapd",
            "top_xxh3": 1, "uploaded_at": 0.0, "shared": [entry]}


@pytest.mark.parametrize("bad", [{"snapshot": ".."}, {"snapshot": "00000002"},
                                 {"file": "../x"}, {"file": "rank-00001/x"},
                                 {"file": "/etc/passwd"}, {"size": -1}, {"file": ".."}])
def test_a_record_naming_a_shared_file_snapd_never_writes_is_refused(bad):
    data = encode_record(_record(**bad))
    with pytest.raises(CorruptSnapshot) as e:
        decode_record(data, where="w", run=RUN, name="00000002")
    assert e.value.field.startswith("shared")


def test_a_record_without_shared_reads_as_sharing_nothing():
    record = _record()
    del record["shared"]
    assert decode_record(encode_record(record), where="w", run=RUN,
                         name="00000002")["shared"] == []


def test_a_multi_rank_record_with_shared_files_is_refused():
    record = _record()
    record.update(world_size=2, top="commit.snapd", files=[["commit.snapd", 5]])
    with pytest.raises(CorruptSnapshot) as e:
        decode_record(encode_record(record), where="w", run=RUN, name="00000002")
    assert e.value.field == "shared"


# --- pull -----------------------------------------------------------------------------

def _uploaded_s2(store, remote, tmp_path):
    s1 = write(store, 1)
    s2, own, size = write_sharing(store, 2, s1, tmp_path)
    upload_snapshot(remote, store, s1.name)
    upload_snapshot(remote, store, s2.name)
    return s1, s2, own, size


def test_pull_brings_the_shared_file_down_to_shared_and_restores(store, remote,
                                                                 tmp_path):
    s1, s2, own, size = _uploaded_s2(store, remote, tmp_path)
    fresh = RunStore(str(tmp_path / "fresh"), RUN)
    path = pull(remote, fresh, s2.name)
    kept = sharing.shared_path(fresh.path, s1.name, own)
    assert os.path.getsize(kept) == size and os.stat(kept).st_mode & 0o777 == 0o600
    assert fresh.committed() == [s2] and not os.listdir(os.path.dirname(kept))[1:]
    reader = SnapshotReader(path)
    reader.verify()
    assert torch.equal(loaded(reader, "base")[".w1"], BASE["w1"])


def test_pull_reads_a_shared_file_found_locally_and_counts_it_as_moved(store, remote,
                                                                       tmp_path):
    s1, s2, own, size = _uploaded_s2(store, remote, tmp_path)
    shutil.rmtree(store.snapshot_path(s2))
    retire(store, s1, own)
    got, moved = [], []   # nothing may be downloaded but the snapshot's own files
    get = remote.fs.__class__.get_file
    remote.fs.get_file = lambda src, dst, **k: (got.append(src), get(remote.fs, src, dst))
    pull(remote, store, s2.name, progress=moved.append)
    assert got and not any("/shared/" in g for g in got)
    assert sum(moved) == remote.read_record(RUN, s2.name)["bytes"] + size
    assert store.committed() == [s2]


def test_pull_refuses_a_record_whose_shared_file_is_missing_remotely(store, remote,
                                                                     tmp_path):
    s1, s2, own, _ = _uploaded_s2(store, remote, tmp_path)
    remote.fs.rm_file(remote.shared_path(RUN, s1.name, own))
    fresh = RunStore(str(tmp_path / "fresh"), RUN)
    with pytest.raises(CorruptSnapshot) as e:
        pull(remote, fresh, s2.name)
    assert e.value.field == "shared" and "/shared/" in e.value.path
    assert fresh.committed() == []


def test_pull_refuses_a_shared_file_of_another_size(store, remote, tmp_path):
    s1, s2, own, _ = _uploaded_s2(store, remote, tmp_path)
    remote.fs.pipe_file(remote.shared_path(RUN, s1.name, own), b"short")
    fresh = RunStore(str(tmp_path / "fresh"), RUN)
    with pytest.raises(CorruptSnapshot) as e:
        pull(remote, fresh, s2.name)
    assert e.value.field == "size" and fresh.committed() == []
    assert not os.path.exists(sharing.shared_path(fresh.path, s1.name, own))


# --- remote retention -----------------------------------------------------------------

def test_retention_keeps_a_shared_file_a_kept_record_lists_and_sweeps_it_after(
        store, remote, tmp_path):
    s1, s2, own, _ = _uploaded_s2(store, remote, tmp_path)
    assert retention.apply(remote, RUN, 1, None) == [s1.name]
    assert remote.commits(RUN) == [s2]
    assert (s1.name, own) in remote.shared_files(RUN)   # s2, kept, lists it
    fresh = RunStore(str(tmp_path / "fresh"), RUN)
    pull(remote, fresh, s2.name)                        # and still pulls whole
    s4 = write(store, 4, {"w1": torch.zeros(8)})        # shares nothing
    upload_snapshot(remote, store, s4.name)
    assert retention.apply(remote, RUN, 1, None) == [s2.name]
    assert remote.shared_files(RUN) == {}
    assert not remote.fs.exists(f"{remote.shared_root(RUN)}/{s1.name}")


def test_no_shared_file_is_swept_while_a_newer_upload_may_need_it(store, remote,
                                                                  tmp_path):
    s1, s2, own, _ = _uploaded_s2(store, remote, tmp_path)
    remote.delete_snapshot(RUN, s2.name)
    remote.fs.pipe_file(remote.file_path(RUN, "00000009", "model.tensors"), b"x")
    assert retention.sweep_shared(remote, RUN) == []
    remote.remove_files(RUN, "00000009")
    assert retention.sweep_shared(remote, RUN) == [(s1.name, own)]


# --- the commands on a remote URL -----------------------------------------------------

def test_verify_inspect_and_export_on_a_url_read_the_shared_file(store, remote, tmp_path):
    from click.testing import CliRunner
    from safetensors.torch import load_file
    from snapd.cli import main
    s1, s2, own, _ = _uploaded_s2(store, remote, tmp_path)
    remote.delete_snapshot(RUN, s1.name)   # only the shared copy of its file is left
    url = remote.url

    def cli(*args):
        return CliRunner().invoke(main, list(args), catch_exceptions=False)
    verified = cli("verify", f"{url}/{RUN}@2")
    assert verified.exit_code == 0, verified.output
    assert cli("inspect", f"{url}/{RUN}@2").exit_code == 0
    out = str(tmp_path / "out.safetensors")
    exported = cli("export", f"{url}/{RUN}@2", "-o", out)
    assert exported.exit_code == 0, exported.output
    assert torch.equal(load_file(out)["w1"], BASE["w1"])
    remote.remove_shared(RUN, s1.name, own)
    damaged = cli("verify", f"{url}/{RUN}@2")
    assert damaged.exit_code == 1 and f"shared/{s1.name}/{own}" in damaged.output
