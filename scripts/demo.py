"""The demo: train, get killed with SIGKILL mid-run, resume, and prove the result exact.

    python scripts/demo.py                 # the whole story, in a few seconds
    python scripts/demo.py --device cuda   # the same on a GPU (CUDA staging and RNG)
    python scripts/demo.py --ranks 2       # the same on a DDP job of 2 ranks (torchrun)
    python scripts/demo.py train --root R --run NAME --steps 48   # one trainer

The story: an uninterrupted reference run trains a small transformer to step N; a
second run of the same script is SIGKILLed between two snapshots, started again,
resumes from its last snapshot and trains on to step N. The demo then compares the
final weights, optimizer moments, scheduler, RNG streams and data position of both:
equal bit for bit, or it says what differs and exits non-zero. With ``--ranks N``
the story is told on every rank of a DDP job under torchrun (scripts/demo_ranks.py).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing.resource_sharer as resource_sharer
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import xxhash
from torch import nn
from torch.utils.data import DataLoader, Dataset

from snapd.progress import read_progress
from snapd.store import RunStore
from snapd_client import Client

VOCAB, SEQ, SAMPLES = 64, 24, 384
DEVICE = "cpu"  # --device: the story's trainers run there


class Sequences(Dataset):
    """A synthetic task: predict (sum of tokens) mod 8 from a token sequence."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=gen)
        self.y = self.x.sum(1) % 8

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 48)
        self.encoder = nn.TransformerEncoderLayer(48, 4, 96, dropout=0.1, batch_first=True)
        self.head = nn.Linear(48, 8)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))


def warmup_cosine(total: int, warmup: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return factor


def state_digest(model, opt, sched, batches, device: str = "cpu") -> dict:
    """Digests of everything the next update depends on."""
    def tensors_digest(state) -> str:
        h = xxhash.xxh3_64()
        for t in _tensors(state):
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
                     .tobytes())
        return h.hexdigest()
    rng = [random.random(), float(np.random.rand()), float(torch.rand(()))]
    if device != "cpu":
        rng.append(float(torch.rand((), device=device)))  # the device's own stream
    return {"weights": tensors_digest(model.state_dict()),
            "optimizer": tensors_digest(opt.state_dict()),
            "lr": sched.get_last_lr()[0],
            "rng": rng,
            "cursor": [batches.epoch, batches.index]}


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            yield from _tensors(value[k])
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def deterministic_device(device: str) -> None:
    """On a GPU, the kernels that give the same bits for the same inputs: a resumed
    run can only equal the reference if the hardware repeats itself."""
    if not device.startswith("cuda"):
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    # Attention through the plain math kernels: the fused ones may accumulate
    # gradients in a different order from run to run.
    for name in ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_cudnn_sdp"):
        if hasattr(torch.backends.cuda, name):
            getattr(torch.backends.cuda, name)(False)


def update(model, opt, sched, batches, accumulate: int, device: str = "cpu") -> float:
    """One optimizer update over ``accumulate`` batches; returns the loss."""
    for _ in range(accumulate):
        x, y = next(batches)
        # input noise from every global RNG, as augmentation would draw it
        x = ((x + torch.randint(0, 2, x.shape)) % VOCAB).to(device)
        loss = nn.functional.cross_entropy(model(x), y.to(device)) / accumulate
        loss = loss * (1 + 0.01 * random.random()) * (1 + 0.01 * float(np.random.rand()))
        loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    return loss.item() * accumulate


def quiet_when_orphaned(worker_id: int) -> None:
    """A DataLoader worker_init_fn: the worker stays silent about its trainer's SIGKILL.

    A worker hands each batch to the trainer as shared memory behind a file descriptor,
    sent from a thread of the worker (multiprocessing's resource sharer). When the
    trainer is killed in the middle of that handoff, the thread meets a reset connection
    and prints a 20-line traceback to the terminal it shares with the demo: torch's
    noise about a parent that is gone, said by the demo in its own words instead. The
    hook drops exactly that error, raised in the resource sharer once the worker's
    parent has died; every other one goes to Python's own hook, so nothing of the
    trainer's or snapd's is hidden."""
    parent, report = os.getppid(), sys.excepthook

    def hook(kind, value, tb) -> None:
        if not _handoff_to_a_dead_parent(kind, tb, parent):
            report(kind, value, tb)
    sys.excepthook = hook


def _handoff_to_a_dead_parent(kind, tb, parent: int) -> bool:
    if not issubclass(kind, (ConnectionError, EOFError)):
        return False
    frames = set()
    while tb is not None:
        frames.add(os.path.realpath(tb.tb_frame.f_code.co_filename))
        tb = tb.tb_next
    if os.path.realpath(resource_sharer.__file__) not in frames:
        return False
    # The dying parent's sockets close before the worker is handed to a new parent:
    # wait a moment for the second sign, so a live parent's error is still reported.
    deadline = time.monotonic() + 2.0
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.02)
    return os.getppid() != parent


def train(root: str, run: str, steps: int, every: int, accumulate: int = 2,
          device: str = "cpu") -> dict:
    deterministic_device(device)
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    torch.set_num_threads(1)
    model = TinyTransformer().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(steps, steps // 8))
    loader = DataLoader(Sequences(), batch_size=16, shuffle=True, num_workers=2,
                        persistent_workers=True, worker_init_fn=quiet_when_orphaned,
                        generator=torch.Generator().manual_seed(7))
    ckpt = Client(root, run, data_version="sequences-v1")
    ckpt.track(model=model, optimizer=opt, scheduler=sched)
    batches = ckpt.batches(loader)
    step = ckpt.restore()
    print(f"[{run}] starting at step {step}", flush=True)
    while step < steps:
        loss = update(model, opt, sched, batches, accumulate, device)
        step += 1
        ckpt.log(step, loss=loss, lr=sched.get_last_lr()[0])
        if step % every == 0:
            ckpt.snapshot(step).wait()
        print(f"[{run}] step {step} loss {loss:.4f}", flush=True)
    ckpt.close()
    return state_digest(model, opt, sched, batches, device)


def _trainer(root: str, run: str, steps: int, every: int, out: str) -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "train", "--root", root, "--run", run,
           "--steps", str(steps), "--every", str(every), "--out", out, "--device", DEVICE]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def _show(line: str) -> None:
    """Echo a trainer's line; step lines only every 8th step, to keep the story short."""
    words = line.split()
    if len(words) > 2 and words[1] == "step" and int(words[2]) % 8:
        return
    print("   " + line.rstrip(), flush=True)


def _run_to_end(root, run, steps, every, out) -> dict:
    proc = _trainer(root, run, steps, every, out)
    for line in proc.stdout:
        _show(line)
    if proc.wait() != 0:
        sys.exit(f"trainer {run} failed with exit code {proc.returncode}")
    with open(out) as f:
        return json.load(f)


def _run_and_kill(root, run, steps, every, kill_at) -> None:
    proc = _trainer(root, run, steps, every, os.devnull)
    for line in proc.stdout:
        _show(line)
        if line.startswith(f"[{run}] step {kill_at} "):
            proc.send_signal(signal.SIGKILL)
            break
    if proc.wait() != -signal.SIGKILL:   # it ended by itself: the story is not told
        sys.exit(f"trainer {run} ended by itself (exit code {proc.returncode}) before "
                 f"step {kill_at}, where the demo was to kill it")
    print(f"   -- trainer SIGKILLed after step {kill_at} (exit {proc.returncode}); its "
          "DataLoader workers, orphaned, exit on their own")


def _stop_daemon(root: str) -> None:
    """The trainers started a daemon for the root; it outlives them by design."""
    try:
        with open(os.path.join(root, ".snapd.lock")) as f:
            pid = int(f.read().strip())
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            os.kill(pid, 0)
            time.sleep(0.1)
    except (OSError, ValueError):
        pass  # gone (or never started)


def _compare(reference: dict, resumed: dict, root: str) -> list:
    differ = [k for k in reference if reference[k] != resumed[k]]
    for key in reference:
        mark = "equal" if key not in differ else "DIFFERENT"
        print(f"   {key:10s} {mark:9s} {resumed[key]}")
    replay = read_progress(RunStore(root, "interrupted")).last_replay or {}
    print(f"   replay check of the recomputed steps {replay.get('from')}..{replay.get('to')}: "
          f"{replay.get('verdict')} ({replay.get('checked')} steps compared with the log)")
    if replay.get("verdict") != "match":
        differ.append("replay")
    return differ


def story(steps: int, every: int, kill_at: int, keep: str | None) -> int:
    root = keep or tempfile.mkdtemp(prefix="snapd-demo-")
    if keep:
        shutil.rmtree(root, ignore_errors=True)
    t0 = time.time()
    print(f"snapd demo: {steps} updates, a snapshot every {every}, on {DEVICE}, "
          f"root {root}")
    try:
        print("1. the reference: one uninterrupted run")
        reference = _run_to_end(root, "reference", steps, every,
                                os.path.join(root, "ref.json"))
        print(f"2. the same run, killed with SIGKILL after step {kill_at}")
        _run_and_kill(root, "interrupted", steps, every, kill_at)
        print("3. started again: it resumes from its last snapshot and finishes")
        resumed = _run_to_end(root, "interrupted", steps, every,
                              os.path.join(root, "res.json"))
        print("4. the final state of both runs")
        differ = _compare(reference, resumed, root)
    finally:   # a failed trainer too: the daemon it started outlives it by design
        _stop_daemon(root)
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    verdict = "IDENTICAL: the resumed run is the same run" if not differ else \
        f"DIVERGED in {', '.join(differ)}"
    print(f"{verdict} ({time.time() - t0:.1f} s)")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    t = sub.add_parser("train", help="run one trainer")
    t.add_argument("--root", required=True)
    t.add_argument("--run", required=True)
    t.add_argument("--steps", type=int, default=48)
    t.add_argument("--every", type=int, default=10)
    t.add_argument("--out", default=os.devnull)
    t.add_argument("--device", default=argparse.SUPPRESS)  # the one before "train"
    parser.add_argument("--device", default="cpu",
                        help="where the model trains: cpu (default), cuda, cuda:N")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=27)
    parser.add_argument("--keep", metavar="DIR", help="keep the checkpoints in DIR")
    parser.add_argument("--ranks", type=int, default=1,
                        help="tell the story on a DDP job of N >= 2 ranks under torchrun "
                             "(gloo, CPU); default 1: one process")
    args = parser.parse_args()
    if args.ranks != 1 and args.command is None:
        if args.ranks < 2 or args.device != "cpu":
            parser.error(f"--ranks {args.ranks}: give N >= 2; the many-rank story "
                         "runs on CPU (gloo), so without --device")
        import demo_ranks   # beside this script; imports this module for the model
        return demo_ranks.story(args.ranks, args.steps, args.every, args.kill_at,
                                args.keep)
    if args.device != "cpu" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device here "
                     f"(torch {torch.__version__})")
    global DEVICE
    DEVICE = args.device
    if args.command == "train":
        result = train(args.root, args.run, args.steps, args.every, device=args.device)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return 0
    return story(args.steps, args.every, args.kill_at, args.keep)


if __name__ == "__main__":
    sys.exit(main())
