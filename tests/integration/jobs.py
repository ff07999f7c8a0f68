"""Multi-rank jobs for the integration tests: a script of tests/multirank/ started by
``python -m torch.distributed.run --standalone --nproc-per-node N script JSON``,
waited for, or SIGKILLed whole when a condition holds.

torchrun starts each worker in a session of its own, so one ``killpg`` of the
launcher's group does not reach them: :meth:`Job.kill` SIGKILLs the launcher's group
and then each worker's (a worker's own children, a DataLoader's, die with it). A
daemon a worker started is not part of the job (it detaches) and survives, as it
would on a node whose trainers crashed. ``--standalone`` picks a free port for each
rendezvous, so jobs in a row do not collide. :class:`WarmJob` is the same launch from
a warm parent, its workers forked.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import psutil

from helpers import wait_exited, wait_for

from snapd import statelog

MULTIRANK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "multirank")
REPO = os.path.dirname(os.path.dirname(MULTIRANK))
TORCHRUN_GROUP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun_group.py")
_NAME = re.compile(r"^(\d{8,})(?:\.L(\d+))?$")   # a snapshot name (docs/format.md)


def job_env(**extra: str) -> Dict[str, str]:
    """One thread per process (2 cores, up to 4 ranks), the repository importable by
    the job scripts, unbuffered output; ``extra`` on top."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "SNAPD_MIN_FREE_BYTES": "0"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    env.pop("SNAPD_DAEMON", None)   # the real daemon, as a user's job gets
    env.update(extra)
    return env


class Job:
    """One torchrun launch of ``script`` with ``nproc`` ranks and settings ``cfg``
    (a JSON argument); its output (launcher and every rank) goes to ``log``."""

    def __init__(self, script: str, nproc: int, cfg: Dict[str, Any], log: str,
                 env: Optional[Dict[str, str]] = None) -> None:
        self.script, self.nproc, self.cfg, self.log = script, nproc, cfg, log
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(nproc), os.path.join(MULTIRANK, script),
                json.dumps(cfg)]
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                         env=env or job_env(), start_new_session=True)

    def output(self, tail: int = 6000) -> str:
        """The log's tail, after the first error line of every rank that has one: a
        rank that crashed first is otherwise hidden behind its peers' tracebacks."""
        with open(self.log, "r", errors="replace") as f:
            text = f.read()
        first: dict = {}
        for line in text.splitlines():
            if line.startswith("[rank") and "Error" in line:
                first.setdefault(line.split("]", 1)[0], line)
        head = "".join(f"first error: {line}\n" for line in first.values())
        return head + text[-tail:]

    def wait(self, timeout: float = 120.0) -> int:
        """The launcher's exit status; a job still running at ``timeout`` is killed
        and the test fails with its output."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.script} x{self.nproc} still running after "
                                 f"{timeout} s; killed. Output:\n{self.output()}") from None

    def expect_ok(self, timeout: float = 120.0) -> "Job":
        rc = self.wait(timeout)
        assert rc == 0, f"{self.script} x{self.nproc} exited {rc}:\n{self.output()}"
        return self

    def wait_until(self, cond: Callable[[], bool], timeout: float, what: str,
                   fail_on: Sequence[str] = ("SnapshotWarning",)) -> None:
        """Wait for ``cond`` while the job runs; fail at once (killing the job) if it
        exits first or its output shows one of ``fail_on``: a snapshot that failed
        will not commit, however long the wait."""
        def holds() -> bool:
            if cond():
                return True
            text = self.output(200_000)
            if self.proc.poll() is not None or any(s in text for s in fail_on):
                self.kill()
                raise AssertionError(f"{self.script} exited ({self.proc.returncode}) or "
                                     f"failed before {what}:\n{self.output()}")
            return False
        if not wait_for(holds, timeout, 0.05):
            self.kill()
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; job "
                                 f"killed. Output:\n{self.output()}")

    def workers(self) -> List[psutil.Process]:
        """Every process the launcher started, and theirs."""
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        """SIGKILL the whole job: the launcher's process group, then each worker's."""
        workers = self.workers()
        groups = [self.proc.pid] + [w.pid for w in workers]
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass   # gone already, or not a group leader: killed with its leader's
        for w in workers:   # a worker that was not a group leader after all
            try:
                w.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(30)
        wait_exited(workers, 30)   # orphans now: init may reap them late


class WarmJob(Job):
    """A :class:`Job` whose torchrun is forked by a warm parent (warm.py) and forks
    its workers (``--run-path --start-method fork``, torchrun_group.py): each worker
    starts with what the parent imported, where ``Job`` starts a new interpreter per
    worker (about 10 s of imports each for transformers). ``script``: a path; the
    launcher leads the job's process group, which :meth:`Job.kill` SIGKILLs whole."""

    def __init__(self, parent: Any, script: str, nproc: int, cfg: Dict[str, Any],
                 log: str, env: Optional[Dict[str, str]] = None) -> None:
        self.script, self.nproc, self.cfg, self.log = script, nproc, cfg, log
        argv = ["--standalone", "--nproc-per-node", str(nproc), "--run-path",
                "--start-method", "fork", os.path.abspath(script), json.dumps(cfg)]
        open(log, "ab").close()   # there before the child opens it: output() reads it
        self.proc = parent.start(TORCHRUN_GROUP, argv, env or job_env(), log)


def run_job(script: str, nproc: int, cfg: Dict[str, Any], log: str,
            timeout: float = 120.0, env: Optional[Dict[str, str]] = None) -> Job:
    """Start a job, wait for it to end well."""
    return Job(script, nproc, cfg, log, env).expect_ok(timeout)


def logged_step(root: str, run: str, rank: int = 0) -> int:
    """The newest step a rank's state log records (0 before any)."""
    run_dir = os.path.join(root, run)
    if not os.path.isdir(statelog.rank_dir(run_dir, rank)):
        return 0
    record = statelog.find_last(run_dir, rank, "step")
    return int(record["step"]) if record else 0


def files_exist(*paths: str) -> Callable[[], bool]:
    return lambda: all(os.path.exists(p) for p in paths)


def snapshot_dir(root: str, run: str, step: int, lineage: int = 0) -> str:
    """``<root>/<run>/snapshots/<name>``, the name as docs/format.md gives it."""
    name = f"{step:08d}" + (f".L{lineage}" if lineage else "")
    return os.path.join(root, run, "snapshots", name)


def newest_snapshot(root: str, run: str) -> str:
    """The committed snapshot newest by (lineage, step), read from the names."""
    base = os.path.join(root, run, "snapshots")
    found = [m for m in map(_NAME.match, os.listdir(base)) if m]
    assert found, f"no committed snapshot in {base}"
    newest = max(found, key=lambda m: (int(m.group(2) or 0), int(m.group(1))))
    return os.path.join(base, newest.group(0))


def parts_dir(root: str, run: str, step: int) -> str:
    """Where the parts of a snapshot not yet globally committed are assembled."""
    path = snapshot_dir(root, run, step)
    return os.path.join(os.path.dirname(path), ".parts-" + os.path.basename(path))


def tensor_file_bytes(snapshot: str) -> int:
    """Bytes of every file of a snapshot but its manifests and commit record."""
    skip = {"manifest.snapd", "commit.snapd"}
    return sum(os.path.getsize(os.path.join(d, f))
               for d, _dirs, files in os.walk(snapshot) for f in files if f not in skip)


def part_files(snapshot: str, rank: int) -> List[str]:
    """The tensor files of one rank's part, largest first."""
    part = os.path.join(snapshot, f"rank-{rank:05d}")
    files = [os.path.join(part, f) for f in os.listdir(part) if f != "manifest.snapd"]
    assert files, f"{part} holds no tensor file"
    return sorted(files, key=os.path.getsize, reverse=True)
