"""`snapd status` after a trainer killed right after snapshot() returned, against the
real daemon: the trainer never logged the commit (it died first), the daemon finished
the write, and status takes the committed directory over the log's view."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

from helpers import wait_until
from snapd.store import RunStore, SnapshotId

TRAINER = textwrap.dedent("""
    import os, signal, sys, torch
    from snapd_client import Client
    root, run = sys.argv[1:3]
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 2048)   # 8 MiB: the write outlives the trainer
    client = Client(root, run)
    client.track(model=model)
    for step in range(1, 21):
        client.log(step, loss=float(step))
        if step == 10:
            client.snapshot(step).wait()  # committed, and logged as committed
    client.snapshot(20)                   # returns once staged and submitted
    os.kill(os.getpid(), signal.SIGKILL)  # dies before the commit is logged
""")


def test_status_counts_the_risk_from_the_snapshot_the_daemon_committed(env, tmp_path,
                                                                       warm):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    # a child of a warm parent (warm.py): a trainer without an import of torch of its own
    proc = warm["first"].run(str(script), [env.root, env.run], timeout=180)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    store = RunStore(env.root, env.run)
    wait_until(lambda: store.read_pointer("LATEST") == SnapshotId(0, 20), 60,
               "the daemon to commit step 20")
    status = subprocess.run([sys.executable, "-m", "snapd", "status", env.root, "--json"],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    (row,) = [r for r in json.loads(status.stdout)["runs"] if r["run"] == env.run]
    assert row["reached"] == 20
    assert row["committed"] == "00000020" and row["at_risk"] == 0, row
    # The log alone still says 10: the directory is what made status right.
    assert row["last_committed"]["step"] == 10, row
    table = subprocess.run([sys.executable, "-m", "snapd", "status", env.root],
                           capture_output=True, text=True, timeout=60).stdout
    assert "00000020" in table, table
