"""Checks of snapd's CUDA paths, in one short run on a machine with a GPU.

    python scripts/device_check.py --out DIR       # on the GPU machine; JSON into DIR
    python scripts/device_check.py --device cpu    # the same checks on CPU: tests this script

Each check prints PASS or FAIL and what it compared; the exit code is 1 if any failed.

1. pinned staging: the staging arena is page-locked (``cudaHostRegister``) and a
   snapshot holds the bytes of the snapshot() instant, bit for bit, in both modes.
2. overlap and forward: a buffer that the next forward changes in place on the GPU
   (as BatchNorm's running statistics are) is saved with its value at snapshot().
   The buffer is large, so that an unordered device-to-host copy would still be
   running when the forward's kernel writes it.
3. restore on the device, hot and from the files, and from the files with
   ``restore(overlap=True)`` (the moments read on a thread, moved to the device before
   the first update), into a freshly initialised model: weights, optimizer state and
   the CUDA random stream equal bit for bit.
4. the demo on the device: a reference run and a SIGKILLed, resumed run end equal.
5. figures: the snapshot() stall of a ~1 GiB CUDA state (wait, overlap) against a
   ``non_blocking`` copy of the same bytes into pinned memory, and torch.save + fsync.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List

import torch
from torch import nn

from snapd_client import Client

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import build_state, state_tensors  # noqa: E402  (scripts/bench.py's state)
from benchlib import close_as_if_killed  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RUN = "device-check"


class Net(nn.Module):
    """Linear layers, and a buffer the forward pass changes in place."""

    def __init__(self, width: int, layers: int, buffer_numel: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        self.register_buffer("seen", torch.zeros(buffer_numel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(1.0)  # like BatchNorm's running statistics
        return self.body(x)


def train_step(model: Net, opt: torch.optim.Optimizer, device: str) -> None:
    x = torch.randn(64, model.body[0].in_features, device=device)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def cpu_state(model: nn.Module, opt: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer, copied to the CPU now, by path."""
    out = {f"model.{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state_dict()["state"].values()):
        for k, v in st.items():
            if torch.is_tensor(v):
                out[f"optimizer.{i}.{k}"] = v.detach().cpu().clone()
    return out


def bitwise_differences(want: Dict[str, torch.Tensor],
                        got: Dict[str, torch.Tensor]) -> List[str]:
    bad = sorted(set(want) ^ set(got))
    for k in sorted(set(want) & set(got)):
        a, b = want[k].reshape(-1), got[k].reshape(-1)
        if a.dtype != b.dtype or a.shape != b.shape or \
                not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            bad.append(k)
    return bad


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# --- checks 1 to 3 ------------------------------------------------------------------

def check_snapshot_and_restore(device: str, mode: str, root: str, sizes: dict,
                               report: Callable[..., None]) -> None:
    torch.manual_seed(0)
    model = Net(**sizes).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = Client(root, RUN, mode=mode)
    ckpt.track(model=model, optimizer=opt)
    for _ in range(2):
        train_step(model, opt, device)
    expected = cpu_state(model, opt)
    handle = ckpt.snapshot(2)
    # Right away, as a training loop does: the device's random stream, a forward
    # that writes the buffer in place, and in overlap mode the step that must wait.
    draw = torch.rand(8, device=device).cpu()
    train_step(model, opt, device)
    handle.wait()
    arena = ckpt._handoff.arena if ckpt._handoff is not None else None
    if device.startswith("cuda"):
        pinned = arena is not None and arena._u8.is_pinned()
        report(f"{mode}: staging arena page-locked", pinned,
               f"arena {arena.name if arena else None} is_pinned() = {pinned}")
    # As a killed trainer: a clean close releases the daemon's hot copy.
    close_as_if_killed(ckpt)

    # restore(overlap=True): the moments arrive on a thread and are loaded (and moved
    # to the device) before the first update; close() waits for them too.
    for source, use_daemon, overlap in (("hot", True, False), ("disk", False, False),
                                        ("disk", False, True)):
        torch.manual_seed(1)  # other weights than the snapshot's
        fresh = Net(**sizes).to(device)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        train_step(fresh, fresh_opt, device)
        c = Client(root, RUN, daemon=use_daemon)
        c.track(model=fresh, optimizer=fresh_opt)
        step = c.restore(overlap=overlap)
        restored_draw = torch.rand(8, device=device).cpu()
        c.close()
        got = cpu_state(fresh, fresh_opt)
        bad = bitwise_differences(expected, got)
        how = ", overlap" if overlap else ""
        report(f"{mode}: restore ({c.restored_from}{how}) equals the state at snapshot()",
               step == 2 and not bad and c.restored_from == source,
               f"step {step}, {len(expected)} tensors, differing: {bad[:5]}, restored "
               f"from {c.restored_from} (want {source}); buffer 'seen' saved as "
               f"{got.get('model.seen', torch.zeros(1))[0].item()}, "
               f"{expected['model.seen'][0].item()} at snapshot()")
        report(f"{mode}: {device} random stream restored ({source}{how})",
               torch.equal(draw, restored_draw), f"{draw[:3].tolist()} vs "
               f"{restored_draw[:3].tolist()}")


# --- check 4 ----------------------------------------------------------------------

def check_demo(device: str, report: Callable[..., None]) -> None:
    proc = subprocess.run([sys.executable, os.path.join(HERE, "demo.py"), "--device", device],
                          capture_output=True, text=True, timeout=600)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    report(f"demo on {device}: resumed run equals the reference",
           proc.returncode == 0 and last.startswith("IDENTICAL"),
           f"exit {proc.returncode}: {last}" + (f"\n{proc.stderr[-2000:]}"
                                                if proc.returncode else ""))


# --- figures ---------------------------------------------------------------------

def median_ms(xs: List[float]) -> float:
    return round(statistics.median(xs) * 1e3, 2)


def measure(device: str, nbytes: int, reps: int, root: str) -> Dict[str, Any]:
    model, opt = build_state(nbytes, torch.get_num_threads(), device)
    tensors = state_tensors(model, opt)
    total = sum(t.numel() * t.element_size() for t in tensors)
    pin = device.startswith("cuda")
    flat = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    views, pos = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        views.append(flat[pos:pos + n].view(t.dtype).view(t.shape))
        pos += n

    def copy_ref() -> float:
        sync(device)
        t0 = time.perf_counter()
        for v, t in zip(views, tensors):
            v.copy_(t, non_blocking=pin)
        sync(device)
        return time.perf_counter() - t0

    copy_ref()
    out: Dict[str, Any] = {"state_bytes": total, "tensors": len(tensors),
                           "copy_pinned_ms": median_ms([copy_ref() for _ in range(reps)])}
    for mode in ("wait", "overlap"):
        ckpt = Client(os.path.join(root, mode), RUN, mode=mode)
        ckpt.track(model=model, optimizer=opt)
        ckpt.snapshot(0).wait()  # warm-up: the daemon starts, the arena is pinned
        stamp: Dict[str, float] = {}
        hook = opt.register_step_pre_hook(lambda *a: stamp.__setitem__("t", time.perf_counter()))
        stalls, durable = [], []
        for i in range(1, reps + 1):
            sync(device)
            t0 = time.perf_counter()
            h = ckpt.snapshot(i)
            called = time.perf_counter()
            opt.step()  # snapd's pre-hook runs first; ours stamps when it let go
            stalls.append(called - t0 + (stamp["t"] - called if mode == "overlap" else 0))
            h.wait()
            durable.append(time.perf_counter() - t0)
        hook.remove()
        ckpt.close()
        out[f"snapd_{mode}_stall_ms"] = median_ms(stalls)
        out[f"snapd_{mode}_durable_ms"] = median_ms(durable)
    saves = []
    path = os.path.join(root, "torch.pt")
    for _ in range(max(2, reps // 2)):
        sync(device)
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        saves.append(time.perf_counter() - t0)
    out["torch_save_fsync_ms"] = median_ms(saves)
    for mode in ("wait", "overlap"):
        stall = out[f"snapd_{mode}_stall_ms"]
        out[f"snapd_{mode}_vs_copy"] = round(stall / out["copy_pinned_ms"], 2)
        out[f"snapd_{mode}_vs_torch_save"] = round(stall / out["torch_save_fsync_ms"], 3)
    return out


# --- driver ----------------------------------------------------------------------

def stop_daemons(root: str) -> None:
    """Every check's client started a daemon for its root; they outlive clients."""
    for dirpath, _dirs, files in os.walk(root):
        if ".snapd.lock" in files:
            try:
                with open(os.path.join(dirpath, ".snapd.lock")) as f:
                    os.kill(int(f.read().strip()), 15)
            except (OSError, ValueError):
                pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", type=float, default=None,
                        help="GiB of state for the figures (default 1 on a GPU, 0.1 on cpu)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--skip-demo", action="store_true")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA "
                     "device; use --device cpu to test the script")
    size = args.size if args.size is not None else (1.0 if args.device != "cpu" else 0.1)
    results: Dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device != "cpu" else platform.processor(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "checks": []}
    failed = []

    def report(name: str, ok: bool, detail: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'}  {name}\n      {detail}", flush=True)
        results["checks"].append({"check": name, "ok": bool(ok), "detail": detail})
        if not ok:
            failed.append(name)

    def guarded(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            report(name, False, traceback.format_exc()[-3000:])

    root = tempfile.mkdtemp(prefix="snapd-device-")
    sizes = {"width": 1024, "layers": 4, "buffer_numel": 64 << 20}  # 256 MiB buffer
    try:
        for mode in ("wait", "overlap"):
            guarded(f"{mode}: snapshot and restore",
                    lambda: check_snapshot_and_restore(args.device, mode,
                                                       os.path.join(root, mode), sizes,
                                                       report))
        if not args.skip_demo:
            guarded("demo", lambda: check_demo(args.device, report))
        t0 = time.perf_counter()
        try:
            results["figures"] = measure(args.device, int(size * 2**30), args.reps,
                                         os.path.join(root, "figures"))
            print("figures:", json.dumps(results["figures"], indent=1), flush=True)
        except Exception:
            report("figures", False, traceback.format_exc()[-3000:])
        results["figures_s"] = round(time.perf_counter() - t0, 1)
    finally:
        stop_daemons(root)
        shutil.rmtree(root, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "device_check.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"{len(results['checks']) - len(failed)} passed, {len(failed)} failed"
          + (f": {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
