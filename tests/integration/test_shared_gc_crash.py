"""kill -9 during gc never breaks a shared file: after a SIGKILL between any two steps
of the keep, the un-commit and the sweep (snapd/keepshared.py, snapd/retention.py),
every committed snapshot's references are found where a reader looks, with the bytes
that were committed, and every committed snapshot verifies (every chunk, shared ones
where the reader finds them); a gc run again finishes the job.

The run: S1 plain, S2 and S3 read S1's model file, S4 plain; an orphan kept file of a
long-deleted snapshot 0. ``gc --keep-last 1`` with S3 protected by LATEST deletes S1
and S2 (S2 first), keeps S1's model file for S3, sweeps the orphan. The child runs
the real ``retention.gc`` and SIGKILLs itself at the k-th step (keepshared's crash
hook), for every k until it finishes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from snapd import sharing
from snapd.options import Options
from snapd.retention import gc
from snapd.store import RunStore, SnapshotId

from sharedsnaps import (MODEL_FILE, RUN, age, resolved, verify_all, write_plain,
                         write_sharing)

pytestmark = pytest.mark.integration

CHILD = textwrap.dedent("""
    import os, signal, sys
    from snapd import keepshared, retention
    from snapd.options import Options
    root, kill_at = sys.argv[1], int(sys.argv[2])
    seen = []
    def hook(point):
        seen.append(point)
        if len(seen) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    keepshared.crash_hook = hook
    retention.gc(root, Options(keep_last=1))
    print(" ".join(seen))
""")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("shared-crash") / "root")
    store = RunStore(root, RUN)
    store.ensure()
    write_plain(store, 1)
    write_sharing(store, 2, 1)
    write_sharing(store, 3, 1)
    write_plain(store, 4)
    store.write_pointer("LATEST", SnapshotId(0, 3))   # kept: S1's file must be too
    orphan = sharing.shared_path(store.path, "00000000", MODEL_FILE)
    os.makedirs(os.path.dirname(orphan))
    shutil.copyfile(os.path.join(store.snapshot_path(SnapshotId(0, 1)), MODEL_FILE), orphan)
    age(orphan)
    return root, resolved(store)


def whole(store: RunStore, expected: dict) -> None:
    """Every committed snapshot reads the bytes committed for it, and verifies."""
    now = resolved(store)
    assert now == {name: expected[name] for name in now}
    assert verify_all(store) == [sid.name for sid in store.committed()]


def test_kill_9_at_every_step_of_gc_leaves_every_snapshot_whole(pristine, tmp_path):
    source, expected = pristine
    steps_done = None
    for kill_at in range(1, 30):
        root = str(tmp_path / f"k{kill_at}")
        shutil.copytree(source, root, symlinks=True)
        child = subprocess.run([sys.executable, "-c", CHILD, root, str(kill_at)],
                               capture_output=True, text=True, timeout=60)
        store = RunStore(root, RUN)
        whole(store, expected)
        if child.returncode == 0:       # ran past its last step: no kill left to try
            steps_done = child.stdout.split()
            break
        assert child.returncode == -9, child.stderr
        gc(root, Options(keep_last=1))  # the next gc finishes the job
        whole(store, expected)
        assert [s.step for s in store.committed()] == [3, 4]
        assert os.listdir(os.path.join(store.path, sharing.SHARED_DIR)) == ["00000001"]
    assert steps_done == ["trashed", "mkdir", "linked", "kept", "trashed", "swept"], steps_done
    assert [s.step for s in RunStore(root, RUN).committed()] == [3, 4]
