"""The SHA-256 of each file of a snapshot, as the real ``sha256sum`` binary computes
it, is what ``snapd inspect --json`` reports (docs/operations.md, "Tamper evidence":
how a user checks a snapshot with standard tools)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from click.testing import CliRunner

from snapd import format as fmt
from snapd.cli import main
from snapd_client import Client

from helpers import small_model_and_opt, small_train_step


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs coreutils' sha256sum")
def test_sha256sum_of_each_file_is_what_inspect_reports(tmp_path):
    root = str(tmp_path)
    model, opt = small_model_and_opt()
    client = Client(root, "r", daemon=False)
    client.track(model=model, optimizer=opt)
    small_train_step(model, opt, 1)
    client.snapshot(1).wait()
    client.close()
    directory = os.path.join(root, "r", "snapshots", "00000001")

    result = CliRunner().invoke(main, ["inspect", "r@1", "--root", root, "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    names = sorted(info["files"])
    assert names == ["model.tensors", "optimizer.tensors"]
    printed = subprocess.run([shutil.which("sha256sum"), *names, fmt.MANIFEST_NAME],
                             cwd=directory, capture_output=True, text=True,
                             check=True).stdout
    sums = {line.split()[1]: line.split()[0] for line in printed.splitlines()}
    assert {n: info["files"][n]["sha256"] for n in names} == {n: sums[n] for n in names}
    assert info["manifest_sha256"] == sums[fmt.MANIFEST_NAME]

    # The lines inspect prints are sha256sum's own format: `sha256sum -c` accepts them.
    text = CliRunner().invoke(main, ["inspect", "r@1", "--root", root]).output
    lines = [line.strip() for line in text.splitlines()
             if line.strip().endswith(".tensors") and len(line.split()) == 2]
    check = subprocess.run([shutil.which("sha256sum"), "-c"], cwd=directory,
                           input="\n".join(lines) + "\n", capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.count(": OK") == 2, check.stdout
