"""Every reading command, on a root on the disk and on the same run behind S3 (moto's
server on 127.0.0.1): one body per command, run against both (snapd/roots.py is the
one seam under them).

The S3 root is filled by the daemon's own uploader and log sync
(snapd/remote/upload.py, snapd/remote/logsync.py) from the disk root, so both hold
the same committed snapshots and the same log.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

from snapd import format as fmt
from snapd.cli import main
from snapd.remote.layout import RemoteRoot
from snapd.remote.logsync import LogSync
from snapd.remote.upload import upload_snapshot
from snapd.store import RunStore
from snapd_client import Client

from helpers import small_model_and_opt, small_train_step

RUN = "gpt"
STEPS, SNAPSHOTS = 5, (2, 4)


def _train(root: str) -> dict:
    """The run trained in-process; returns the model's weights at step 4."""
    model, opt = small_model_and_opt()
    client = Client(root, RUN, data_version="v1", daemon=False)
    client.track(model=model, optimizer=opt)
    for step in range(1, STEPS + 1):
        client.log(step, loss=small_train_step(model, opt, step))
        if step in SNAPSHOTS:
            client.snapshot(step).wait()
        if step == 4:
            at_4 = {k: v.clone() for k, v in model.state_dict().items()}
    client.close()
    return at_4


@pytest.fixture(scope="module")
def both(s3_server, tmp_path_factory):
    """(the disk root, the S3 URL holding the same run, the weights at step 4)."""
    disk = str(tmp_path_factory.mktemp("disk"))
    at_4 = _train(disk)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3_server.env.items():
            mp.setenv(key, value)
        url = s3_server.url("every-root")
        remote = RemoteRoot(url)
        for sid in RunStore(disk, RUN).committed():
            upload_snapshot(remote, RunStore(disk, RUN), sid.name)
        LogSync(remote, disk).sync(RUN)
        yield disk, url, at_4


@pytest.fixture(params=["disk", "s3"])
def root(request, both, s3_server, monkeypatch):
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    disk, url, _ = both
    return disk if request.param == "disk" else url


def snapd(*args: str):
    return CliRunner().invoke(main, list(args), env={"COLUMNS": "200"},
                              catch_exceptions=False)


def test_ls(root, both):
    result = snapd("ls", RUN, "--root", root, "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["snapshots"]
    assert [(r["name"], r["step"], r["marks"], r["verified"], r["world_size"])
            for r in rows] == [("00000002", 2, [], "manifest ok", 1),
                               ("00000004", 4, ["LATEST"], "manifest ok", 1)]
    on_disk = RunStore(both[0], RUN).snapshots_path   # the files the manifest lists
    assert [r["bytes"] for r in rows] == [
        sum(os.path.getsize(os.path.join(on_disk, r["name"], f))
            for f in os.listdir(os.path.join(on_disk, r["name"]))
            if f != fmt.MANIFEST_NAME) for r in rows]
    verified = snapd("ls", RUN, "--root", root, "--verify")
    assert verified.exit_code == 0 and verified.output.count(" ok") == 2, verified.output


def test_status(root):
    result = snapd("status", root, "--json")
    assert result.exit_code == 0, result.output
    [row] = json.loads(result.output)["runs"]
    assert (row["run"], row["reached"], row["committed"], row["at_risk"]) == \
        (RUN, STEPS, "00000004", STEPS - 4)


def test_inspect(root):
    result = snapd("inspect", f"{RUN}@4", "--root", root, "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert (info["step"], sorted(info["objects"]), info["files_problem"],
            info["data_version"]) == (4, ["model", "optimizer"], None, "v1")


def test_verify(root):
    one = snapd("verify", f"{RUN}@2", "--root", root)
    assert one.exit_code == 0 and one.output.startswith("ok"), one.output
    every = json.loads(snapd("verify", "--all", "--root", root, "--json").output)
    assert every["ok"] and [r["snapshot"].rsplit("@", 1)[-1].rsplit("/", 1)[-1]
                            for r in every["snapshots"]] in (["00000002", "00000004"],
                                                             ["2", "4"])


def test_diff(root):
    same = snapd("diff", f"{RUN}@4", f"{RUN}@latest", "--root", root, "--json")
    assert same.exit_code == 0, same.output
    other = json.loads(snapd("diff", f"{RUN}@2", f"{RUN}@4", "--root", root,
                             "--json").output)
    assert other["exit_code"] == 1 and other["steps"] == [2, 4]


def test_export(root, both, tmp_path):
    from safetensors.torch import load_file
    out = str(tmp_path / "w.safetensors")
    result = snapd("export", f"{RUN}@4", "--root", root, "-o", out)
    assert result.exit_code == 0, result.output
    saved, at_4 = load_file(out), both[2]
    assert saved.keys() == at_4.keys()
    assert all(torch.equal(saved[k], at_4[k]) for k in saved)
