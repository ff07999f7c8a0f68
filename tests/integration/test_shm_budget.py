"""Shared memory of a run, with a real trainer process and its daemon: the state at
most twice with hot restore (the slot being staged and the committed one, which the
daemon serves as the hot copy), once without; and a SIGKILLed trainer's restart
still restores from memory, bit for bit, after which the dead trainer's arena is let
go: the restarted run holds the state at most twice as well, not four times (its new
arena beside the old one until its first commit)."""

from __future__ import annotations

import json
import os
import signal
import textwrap

import pytest
import torch

from snapd_client import Client

pytestmark = pytest.mark.integration

TRAINER = textwrap.dedent("""
    import json, os, signal, sys, torch
    from snapd_client import Client
    root, run, out, hot = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"

    def shm_bytes(pids):
        # Every /dev/shm/snapd-* file mapped by these processes (named or unlinked),
        # and every one named for this run or trainer, counted once by inode.
        sizes = {}
        for pid in pids:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) >= 6 and parts[5].startswith("/dev/shm/snapd-"):
                        lo, hi = (int(x, 16) for x in parts[0].split("-"))
                        sizes[parts[4]] = max(sizes.get(parts[4], 0), hi - lo)
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"snapd-hot-{os.getuid()}-{run}-") or \\
                    name.startswith(f"snapd-{os.getuid()}-{os.getpid()}-"):
                st = os.stat(f"/dev/shm/{name}")
                sizes[str(st.st_ino)] = max(sizes.get(str(st.st_ino), 0), st.st_size)
        return sum(sizes.values())

    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 4096, bias=False)   # 32 MiB, whole 2 MiB steps
    client = Client(root, run, hot_restore=hot)
    client.track(model=model)
    for step in range(1, 5):
        with torch.no_grad():
            model.weight.mul_(1.01)
        client.snapshot(step).wait()
    state = model.weight.numel() * 4
    torch.save(model.state_dict(), out + ".pt")
    with open(out, "w") as f:
        json.dump({"state": state, "shm": shm_bytes([os.getpid(), client.daemon_pid])}, f)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("hot, bound, source", [(True, 2.05, "hot"), (False, 1.05, "disk")])
def test_shared_memory_of_a_run_and_a_killed_trainers_restart(env, tmp_path, hot, bound,
                                                               source, warm):
    script, out = tmp_path / "trainer.py", tmp_path / "out.json"
    script.write_text(TRAINER)
    # a child of a warm parent (warm.py): a trainer without an import of torch of its own
    proc = warm["first"].run(str(script), [env.root, env.run, str(out), "1" if hot else "0"],
                             timeout=300)
    env.pids.add(proc.pid)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    measured = json.loads(out.read_text())
    assert 0 < measured["shm"] <= bound * measured["state"], measured

    model = torch.nn.Linear(2048, 4096, bias=False)
    client = Client(env.root, env.run, hot_restore=hot)
    client.track(model=model)
    try:
        assert client.restore() == 4 and client.restored_from == source
        env.daemon(client)
        assert client._handoff.arena is not None   # restore() made it, before any commit
        assert run_shm_bytes(env.run) <= bound * measured["state"]
    finally:
        client.close()
    expected = torch.load(str(out) + ".pt")["weight"]
    assert torch.equal(model.weight, expected)   # bit for bit


def run_shm_bytes(run: str) -> int:
    """The /dev/shm files of ``run`` now: its hot copies and this process's arenas."""
    uid, total = os.getuid(), 0
    for name in os.listdir("/dev/shm"):
        if name.startswith((f"snapd-hot-{uid}-{run}-", f"snapd-{uid}-{os.getpid()}-")):
            total += os.stat(f"/dev/shm/{name}").st_size
    return total
