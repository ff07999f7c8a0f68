"""A full disk at a run's start: ``Client()`` and ``restore()`` raise InsufficientSpace
naming the file, the mount and the way out, never a bare ``OSError: [Errno 28]``;
once space is freed the same calls go on, and nothing written before was lost.

The disk is really full: the trainer (full_disk_job.py) runs in a private mount
namespace (``unshare -m``; ``-Urm``, a user namespace, when not root) where each case
has a 1 MiB tmpfs of its own, filled to its last byte. Nothing is mounted outside
that namespace, and the mounts go with it when the trainer exits.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "full_disk_job.py")
CASES = ("client", "fresh", "resume")
ADVICE = ("; the filesystem mounted at {mount} (which holds the root {mount}/root) is "
          "full. Free space on {mount}, or point the Client at a root on another disk "
          "(Client(root=...))")


def namespace_command() -> list:
    return ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-Urm"]


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """Each case's mount point and what the trainer reported for it."""
    base = tmp_path_factory.mktemp("full-disk")
    mounts = {case: str(base / case) for case in CASES}
    for mount in mounts.values():
        os.mkdir(mount)
    mount_all = " && ".join(f"mount -t tmpfs -o size=1m tmpfs {shlex.quote(m)}"
                            for m in mounts.values())
    job = shlex.join([sys.executable, JOB] + [f"{c}={m}" for c, m in mounts.items()])
    command = namespace_command() + ["sh", "-c", f"{mount_all} && exec {job}"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        proc.kill()   # SIGKILL; a no-op once it exited
        proc.wait()
    assert proc.returncode == 0, err[-3000:]
    for mount in mounts.values():   # the tmpfs went with the namespace
        assert os.listdir(mount) == []
    return mounts, json.loads(out.splitlines()[-1])


def expect(mounts, case, file, doing):
    mount = mounts[case]
    path = os.path.join(mount, "root", "r", file)
    return path, (f"{path}: No space left on device while {doing}"
                  + ADVICE.format(mount=mount))


def check(got, path, message):
    assert got["class"] == "InsufficientSpace" and got["module"] == "snapd.errors"
    assert got["message"] == message
    assert (got["path"], got["field"], got["errno"]) == (path, "root", 28)
    assert got["is_oserror"]   # callers that catch OSError still catch it


def test_client_on_a_full_disk_names_the_lock_file_and_the_way_out(started):
    mounts, results = started
    path, message = expect(mounts, "client", ".writer-00000.lock",
                           "writing this process's pid into the writer lock of run 'r'")
    check(results["client"], path, message)
    assert results["client"]["retry_step"] == 0   # the failed Client held no lock


def test_restore_of_a_new_run_on_a_full_disk_names_the_log_segment(started):
    mounts, results = started
    path, message = expect(mounts, "fresh", "log/rank-00000/000000000001.log",
                           "creating a state-log segment")
    check(results["fresh"], path, message)
    assert results["fresh"]["retry_step"] == 0


def test_restore_of_a_snapshot_on_a_full_disk_keeps_it_for_the_retry(started):
    mounts, results = started
    path, message = expect(mounts, "resume", "log/rank-00000/000000000002.log",
                           "creating a state-log segment")
    check(results["resume"], path, message)
    assert results["resume"]["retry_step"] == 2   # the snapshot is whole, resumed
