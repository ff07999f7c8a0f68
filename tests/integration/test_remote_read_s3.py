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
