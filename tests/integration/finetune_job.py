"""A LoRA fine-tuning trainer for tests/integration/test_finetune_daemon.py, through
the real daemon (the client starts it), a snapshot every step.

    finetune_job.py JSON    {"root", "run", "out", "steps", "pause_at"}

``pause_at``: after step k's snapshot is durable, write ``OUT/paused`` and wait for
the test's SIGKILL. At the end: ``OUT/final.pt`` (the model's and optimizer's state,
tensors only) and ``OUT/snapshots.json``: per snapshot, its step, the bytes it staged
and the bytes the daemon wrote, and the trainable state's bytes.
"""

import json
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lora  # noqa: E402  (tests/lora.py)

from snapd_client import Client  # noqa: E402

D, RANK = 512, 8
# One thread, as the other jobs: a resumed run is compared bit for bit with a run of
# another process, and a matmul split over threads may sum in another order there
# (this job ran side by side with another trainer, the resume alone).
torch.set_num_threads(1)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    model, opt = lora.build(D, rank=RANK, seed=cfg.get("seed", 0))
    ckpt = Client(cfg["root"], cfg["run"])
    ckpt.track(model=model, optimizer=opt)
    step = ckpt.restore()
    handles = []
    while step < cfg["steps"]:
        step += 1
        lora.train_step(model, opt, step, D)
        ckpt.log(step)
        handles.append(ckpt.snapshot(step))
        if step == cfg.get("pause_at"):
            handles[-1].wait()
            open(os.path.join(cfg["out"], "paused"), "w").close()
            while True:
                signal.pause()   # until the test's SIGKILL
    ckpt.close()
    torch.save({"model": model.state_dict(),
                "opt": [dict(s) for s in opt.state.values()]},
               os.path.join(cfg["out"], "final.pt"))
    with open(os.path.join(cfg["out"], "snapshots.json"), "w") as f:
        json.dump({"first_step": handles[0].step if handles else None,
                   "trainable": lora.trainable_bytes(model, opt),
                   "snapshots": [{"step": h.step, "staged": h.staged_bytes,
                                  "written": h.result.bytes_written,
                                  "path": h.result.path} for h in handles]}, f)


if __name__ == "__main__":
    main()
