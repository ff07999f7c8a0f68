"""The reading side on a real S3 API (moto's server on 127.0.0.1): a snapshot copied
up as the daemon uploads it, then listed, pulled and verified through s3://."""

from __future__ import annotations

import os

import torch
from click.testing import CliRunner

from snapd import format as fmt
from snapd.cli import main
from snapd.remote import layout
from snapd.remote.layout import RemoteFile, RemoteRoot
from snapd.store import RunStore, SnapshotId
from snapd_client import Client

RUN = "gpt"


def committed_snapshot(root: str) -> str:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    client = Client(root, RUN, daemon=False)
    client.track(model=model)
    client.snapshot(3).wait()
    client.close()
    return RunStore(root, RUN).snapshot_path(SnapshotId(0, 3))


def copy_up(remote: RemoteRoot, local: str, name: str) -> None:
    """Files first, the record last (docs/remote.md, the commit rule)."""
    files = []
    for rel in sorted(os.listdir(local)):
        remote.fs.put_file(os.path.join(local, rel), remote.file_path(RUN, name, rel))
        files.append(RemoteFile(rel, os.path.getsize(os.path.join(local, rel))))
    with open(os.path.join(local, fmt.MANIFEST_NAME), "rb") as f:
        top = f.read()
    remote.write_record(RUN, name, layout.make_record(RUN, SnapshotId.parse(name), 1,
                                                      files, top))


def test_ls_pull_and_verify_on_an_s3_url(s3_env, tmp_path):
    url = s3_env.url()
    local = committed_snapshot(str(tmp_path / "node-a"))
    copy_up(RemoteRoot(url), local, "00000003")
    runner = CliRunner()
    listed = runner.invoke(main, ["ls", url])
    assert listed.exit_code == 0 and "00000003" in listed.output, listed.output
    root = str(tmp_path / "node-b")
    pulled = runner.invoke(main, ["pull", url, f"{RUN}@3", "--root", root])
    assert pulled.exit_code == 0, pulled.output
    path = RunStore(root, RUN).snapshot_path(SnapshotId(0, 3))
    for name in os.listdir(local):
        with open(os.path.join(local, name), "rb") as a, \
                open(os.path.join(path, name), "rb") as b:
            assert a.read() == b.read(), name
    verified = runner.invoke(main, ["verify", f"{url}/{RUN}@3"])
    assert verified.exit_code == 0 and "ok" in verified.output, verified.output


def sharing_snapshot(store: RunStore, aside: str) -> tuple:
    """Snapshot 3 as above, and snapshot 4 whose tensors read snapshot 3's tensor file
    (format v4 ``shared`` + ``src``), committed by a rename into ``snapshots/``."""
    from snapd.writer import write_snapshot   # the daemon's writer, in process
    from snapd.options import Options
    from snapd.plan import ObjectPlan, SnapshotPlan, TensorSource
    from snapd_client.capture import tensor_bytes
    from snapd_client.state import flatten

    def write(run_store: RunStore, step: int) -> SnapshotId:
        flat = flatten({"w": torch.arange(4096, dtype=torch.float32)}, "model")
        tensors = [TensorSource(p, "float32", list(t.shape), tensor_bytes(t))
                   for p, t in zip(flat.paths, flat.tensors)]
        plan = SnapshotPlan(RUN, step, {"id": 0, "mode": "fresh", "parent": None},
                            [ObjectPlan("model", "x.Y", flat.skeleton, tensors)],
                            {"python": b"s"})
        return write_snapshot(run_store, plan, Options()).sid

    first = write(store, 3)
    second = write(RunStore(aside, RUN), 4)
    tmp = os.path.join(store.snapshots_path, ".tmp-hand")
    os.rename(RunStore(aside, RUN).snapshot_path(second), tmp)
    path = os.path.join(tmp, fmt.MANIFEST_NAME)
    with open(path, "rb") as f:
        manifest = fmt.decode_manifest(f.read(), path=path)
    obj = manifest["objects"]["model"]
    own = obj["file"]
    size = os.path.getsize(os.path.join(store.snapshot_path(first), own))
    manifest["shared"] = [{"snapshot": first.name, "file": own, "size": size, "format": fmt.FORMAT_VERSION}]
    for t in obj["tensors"]:
        t["src"] = 0
    obj["file"] = None
    del manifest["files"][own]
    os.unlink(os.path.join(tmp, own))
    with open(path, "wb") as f:
        f.write(fmt.encode_manifest(manifest))
    os.rename(tmp, store.snapshot_path(second))
    return first, second, own


def test_a_snapshot_sharing_an_earlier_file_goes_up_and_comes_down_through_s3(
        s3_env, tmp_path):
    from snapd.remote.pull import pull
    from snapd.remote.upload import upload_snapshot
    from snapd.reader import SnapshotReader
    url = s3_env.url()
    store = RunStore(str(tmp_path / "node-a"), RUN)
    first, second, own = sharing_snapshot(store, str(tmp_path / "aside"))
    remote = RemoteRoot(url)
    record = upload_snapshot(remote, store, second.name)
    assert [s["file"] for s in record["shared"]] == [own]
    assert remote.commits(RUN) == [second]   # the first was never uploaded itself
    fresh = RunStore(str(tmp_path / "node-b"), RUN)
    reader = SnapshotReader(pull(RemoteRoot(url), fresh, second.name))
    assert os.path.exists(os.path.join(fresh.path, "shared", first.name, own))
    assert torch.equal(reader.load_object("model")[0],
                       torch.arange(4096, dtype=torch.float32))
