"""The demo's story on N ranks: a DDP job under torchrun, SIGKILLed whole, resumed.

    python scripts/demo.py --ranks 2       # the whole story (scripts/demo.py runs it)
    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        scripts/demo_ranks.py --root R --name RUN --steps 48 --out DIR   # one job

The same story as the single-rank demo, on every rank of a DDP job (gloo, CPU): an
uninterrupted reference job trains to step N; a second job is SIGKILLed whole (the
launcher and every rank at once, as a scheduler ends a job) between two snapshots,
started again, resumes every rank from the last globally committed snapshot and
trains on to step N. Each rank draws its own dropout and input noise and reads its
own shard of a shuffled ``DistributedSampler``, so every rank's RNG streams and data
position must come back as its own. The demo then compares, rank by rank, the final
weights, optimizer moments, scheduler, RNG streams and data position of both jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque

import numpy as np
import psutil
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from demo import Sequences, TinyTransformer, _show, state_digest, update, warmup_cosine
from snapd.progress import read_progress
from snapd.store import RunStore
from snapd_client import Client


def train_rank(root: str, run: str, steps: int, every: int, accumulate: int = 2) -> dict:
    """One rank of the job: the README's six calls after init_process_group."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DDP(TinyTransformer())
    # From here every rank draws its own dropout masks and noise: its own streams.
    torch.manual_seed(100 + rank), random.seed(rank), np.random.seed(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(steps, steps // 8))
    data = Sequences()
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, seed=7))
    ckpt = Client(root, run, data_version="sequences-v1")   # rank, world: from dist
    ckpt.track(model=model, optimizer=opt, scheduler=sched)
    batches = ckpt.batches(loader)   # calls the sampler's set_epoch each epoch
    step = ckpt.restore()            # every rank: the same globally committed step
    print(f"[{run}] rank {rank} starting at step {step}", flush=True)
    while step < steps:
        loss = update(model, opt, sched, batches, accumulate)   # per-rank input noise
        step += 1
        ckpt.log(step, loss=loss, lr=sched.get_last_lr()[0])
        if step % every == 0:
            ckpt.snapshot(step).wait()   # this rank's part durable; no collective
        if rank == 0:
            print(f"[{run}] step {step} loss {loss:.4f}", flush=True)
    ckpt.close()   # waits (bounded) for the newest snapshot's global commit
    return state_digest(model, opt, sched, batches)


# --- the story (the launcher's side) -------------------------------------------------

def _job(root: str, run: str, ranks: int, steps: int, every: int, out: str):
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(ranks), os.path.abspath(__file__), "--root", root,
           "--name", run, "--steps", str(steps), "--every", str(every), "--out", out]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)


def _lines(proc, run: str, tail: deque):
    """The job's output: our lines echoed (torchrun's own kept for an error)."""
    for line in proc.stdout:
        tail.append(line)
        if line.startswith(f"[{run}]"):
            _show(line)
            yield line


def _run_to_end(root, run, ranks, steps, every, out) -> list:
    proc, tail = _job(root, run, ranks, steps, every, out), deque(maxlen=80)
    for _ in _lines(proc, run, tail):
        pass
    if proc.wait() != 0:
        sys.exit(f"job {run} failed with exit code {proc.returncode}:\n" + "".join(tail))
    digests = []
    for r in range(ranks):
        with open(os.path.join(out, f"rank-{r}.json")) as f:
            digests.append(json.load(f))
    return digests


def _kill_job(proc, root: str) -> None:
    """SIGKILL the launcher and every rank (each rank is its own session under
    torchrun, so a process-group kill would miss them); never the daemon."""
    daemon = None
    try:
        with open(os.path.join(root, ".snapd.lock")) as f:
            daemon = int(f.read().strip())
    except (OSError, ValueError):
        pass
    launcher = psutil.Process(proc.pid)
    job = [launcher] + launcher.children(recursive=True)
    for p in job:
        if p.pid != daemon:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass


def _run_and_kill(root, run, ranks, steps, every, kill_at, out) -> None:
    proc, tail = _job(root, run, ranks, steps, every, out), deque(maxlen=80)
    for line in _lines(proc, run, tail):
        if line.startswith(f"[{run}] step {kill_at} "):
            _kill_job(proc, root)
            break
    if proc.wait() != -signal.SIGKILL:   # it ended by itself: the story is not told
        sys.exit(f"job {run} ended by itself (exit code {proc.returncode}) before step "
                 f"{kill_at}, where the demo was to kill it:\n" + "".join(tail))
    print(f"   -- the whole job SIGKILLed after step {kill_at}: launcher and "
          f"{ranks} ranks (exit {proc.returncode})")


def _stop_daemon(root: str) -> None:
    try:
        with open(os.path.join(root, ".snapd.lock")) as f:
            pid = int(f.read().strip())
        os.kill(pid, signal.SIGTERM)
        psutil.Process(pid).wait(10)
    except (OSError, ValueError, psutil.Error):
        pass   # gone (or never started)


def _compare(reference: list, resumed: list, root: str, run: str) -> list:
    differ = []
    for r, (ref, res) in enumerate(zip(reference, resumed)):
        for key in ref:
            same = ref[key] == res[key]
            if not same:
                differ.append(f"rank {r} {key}")
            print(f"   rank {r} {key:10s} {'equal' if same else 'DIFFERENT':9s} {res[key]}")
    if len({d["weights"] for d in resumed}) != 1:
        differ.append("weights across ranks")
    for r in range(len(resumed)):
        replay = read_progress(RunStore(root, run), rank=r).last_replay or {}
        print(f"   rank {r} replay check of the recomputed steps {replay.get('from')}.."
              f"{replay.get('to')}: {replay.get('verdict')} ({replay.get('checked')} "
              "steps compared with its log)")
        if replay.get("verdict") != "match":
            differ.append(f"rank {r} replay")
    return differ


def _on_disk(root: str, run: str) -> None:
    """What the last snapshot holds: one part per rank, the replicated state once."""
    store = RunStore(root, run)
    last = store.committed()[-1]
    path = os.path.join(store.snapshots_path, last.name)
    parts = sorted(n for n in os.listdir(path) if n.startswith("rank-"))
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    print(f"   snapshot {last.name}: {len(parts)} parts ({', '.join(parts)}), "
          f"{size / 1024:.0f} KiB in all: the model and optimizer once, each rank's "
          "RNG streams and data position in its own part")


def story(ranks: int, steps: int, every: int, kill_at: int, keep) -> int:
    root = keep or tempfile.mkdtemp(prefix="snapd-demo-")
    if keep:
        shutil.rmtree(root, ignore_errors=True)
    t0 = time.time()
    print(f"snapd demo on {ranks} ranks (DDP under torchrun, gloo, CPU): {steps} updates, "
          f"a snapshot every {every}, root {root}")
    try:
        print("1. the reference: one uninterrupted job")
        reference = _run_to_end(root, "reference", ranks, steps, every, f"{root}/ref-out")
        print(f"2. the same job, every process SIGKILLed after step {kill_at}")
        _run_and_kill(root, "interrupted", ranks, steps, every, kill_at, f"{root}/kill-out")
        print("3. started again: every rank resumes from the last global commit and "
              "finishes")
        resumed = _run_to_end(root, "interrupted", ranks, steps, every, f"{root}/res-out")
        print("4. the final state of both jobs, rank by rank")
        differ = _compare(reference, resumed, root, "interrupted")
        _on_disk(root, "interrupted")
    finally:   # a failed job too: the daemon the ranks started outlives them by design
        _stop_daemon(root)
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    verdict = "IDENTICAL: on every rank, the resumed job is the same job" if not differ \
        else f"DIVERGED in {', '.join(differ)}"
    print(f"{verdict} ({time.time() - t0:.1f} s)")
    return 1 if differ else 0


@record   # torchrun's report of a failed job then carries the rank's traceback
def main() -> int:
    """One rank of a job (under torchrun)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True)
    # not --run: torchrun would take it for an abbreviation of its --run-path
    p.add_argument("--name", required=True, help="the run")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--out", required=True, help="directory for rank-R.json")
    args = p.parse_args()
    digest = train_rank(args.root, args.name, args.steps, args.every)
    with open(os.path.join(args.out, f"rank-{os.environ['RANK']}.json"), "w") as f:
        json.dump(digest, f)
    # Every rank done, then out without tearing the process groups down: torch's gloo
    # backend aborts a rank now and then in that teardown ("terminate called without
    # an active exception"), which would fail a job whose work is all done.
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
