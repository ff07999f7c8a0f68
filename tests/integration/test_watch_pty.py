"""``snapd watch`` end to end: a real pseudo-terminal, a live daemon, a training process.

One trainer (its own process, ``Client(daemon=True)``, which starts the daemon) logs
every step and snapshots every 10 steps, slowly, for the whole module. The view runs
in a pty of 40x120 and must show the step advancing and a committed snapshot; piped,
it must print a ``committed`` line for a snapshot committed after it started.
Teardown kills the trainer, stops the daemon and removes the short root under /tmp.
The trainer is a child forked by a warm parent (warm.py, the ``warm`` fixture), which
has imported torch already.
"""

from __future__ import annotations

import os
import queue
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pexpect
import pytest

from helpers import stop_daemons_under
from snapd.store import RunStore

pytestmark = pytest.mark.integration

TRAINER = textwrap.dedent("""
    import sys, time, torch
    from snapd_client import Client

    root, run, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt = Client(root, run, daemon=True)
    ckpt.track(model=model, optimizer=opt)
    x = torch.randn(16, 64)
    for step in range(1, steps + 1):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.log(step, loss=loss.item())
        if step % 10 == 0:
            ckpt.snapshot(step)
        time.sleep(0.05)   # the behaviour: a slow trainer, so the view sees it move
    ckpt.close()
""")


def _env():
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="120", LINES="40")
    env.pop("SNAPD_DAEMON", None)   # the real daemon (conftest sets 0 for unit tests)
    return env


@pytest.fixture(scope="module")
def training(tmp_path_factory, warm):
    """(root, run, trainer, its stderr's file): a trainer running for ~30 s (killed at
    teardown) under a short root."""
    root = tempfile.mkdtemp(prefix="sd-", dir="/tmp")   # socket path < 107 bytes
    run = f"w{secrets.token_hex(3)}"
    folder = tmp_path_factory.mktemp("watch")
    script = folder / "train.py"
    script.write_text(TRAINER)
    stderr = str(folder / "train.stderr")
    trainer = warm["first"].start(str(script), [root, run, "600"], _env(), os.devnull, stderr)
    try:
        yield root, run, trainer, stderr
    finally:
        trainer.kill()
        trainer.wait(10)
        stop_daemons_under(root)
        shutil.rmtree(root, ignore_errors=True)


def _watch(root: str) -> list:
    return [sys.executable, "-m", "snapd", "watch", root, "--interval", "0.5"]


def test_live_view_in_a_pty_shows_steps_advancing_and_a_commit(training):
    root, run, trainer, stderr = training
    argv = _watch(root)
    child = pexpect.spawn(argv[0], argv[1:], dimensions=(40, 120), env=_env(),
                          encoding="utf-8", timeout=30)
    try:
        # The training table's row: run, rank 0, then the step (never zero-padded,
        # unlike the snapshot names of the snapshots table's row).
        row = re.compile(rf"{run}\s+0\s+([1-9]\d*)\s")
        child.expect(row)
        first = int(child.match.group(1))
        later = first
        while later == first:
            child.expect(row)
            later = int(child.match.group(1))
        assert later > first
        child.expect(re.compile(r"(\d{8})\s+\d+(?:\.\d)?[smhd] ago"))   # last committed
        assert int(child.match.group(1)) % 10 == 0 and int(child.match.group(1)) >= 10
        child.expect("daemon pid")
        assert trainer.poll() is None, read(stderr)
    finally:
        child.terminate(force=True)
        child.close()


def _lines(proc: subprocess.Popen) -> "queue.Queue[str]":
    lines: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout],
                     daemon=True).start()
    return lines


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_piped_output_prints_a_line_per_event(training):
    root, run, trainer, stderr = training
    assert trainer.poll() is None, read(stderr)
    latest = RunStore(root, run).read_pointer("LATEST")
    before = latest.step if latest else 0
    argv = _watch(root)
    proc = subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, text=True)
    lines, seen, deadline = _lines(proc), [], time.monotonic() + 20
    committed = re.compile(rf"run={run} rank=0 snapshot committed step=(\d+) name=\d{{8}}")
    try:
        while time.monotonic() < deadline:
            try:
                seen.append(lines.get(timeout=0.5))
            except queue.Empty:
                continue
            match = committed.search(seen[-1])
            if match and int(match.group(1)) > before and \
                    any(re.search(rf"run={run} rank=0 step=\d+ loss=", s) for s in seen):
                break
        else:
            pytest.fail("no new committed line within 20 s; got:\n" + "".join(seen))
        assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d ", seen[-1])
        assert any("daemon running pid=" in s for s in seen)
    finally:
        proc.terminate()
        proc.wait(10)
