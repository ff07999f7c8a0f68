"""A stock Hugging Face Trainer script (a two-layer GPT-2 from its config on generated
tokens, dropout, gradient accumulation 2, a cosine schedule with warmup, evaluation
every 4 steps), run by test_transformers_resume.py. snapd changes one line, marked
``# snapd``:

    -from transformers import Trainer
    +from snapd_client.transformers import Trainer

``python hf_job.py CONFIG_JSON``; CONFIG: ``out`` (this run's files), ``output_dir``
(default ``out``), ``run_name`` (snapd's run name too), ``args`` (more
TrainingArguments), ``mode`` ("snapd",
"own": transformers.Trainer resuming with ``resume_from_checkpoint=True`` from its
checkpoints every ``save_steps``, or "none"), ``workers``, ``epochs``, and the test's
``kills``: points where the process SIGKILLs itself, each once (a file in ``out``
records it, so that the same command, started again, goes past it):
``["step_end", k]`` (on_step_end of step k, before its snapshot), ``["substep", k]``
(in step k+1's accumulation window), ``["step_begin", k]`` (right after step k's
snapshot was handed off, while it is written), ``["save", k]`` (own mode: in
``_save_checkpoint`` of step k, after the weights, before the optimizer),
``["pause", k]`` (in step k+1's accumulation window: write ``paused-<rank>`` in
``out`` and wait for the test's SIGKILL of the whole job). At the end it writes
``final.safetensors`` (weights and optimizer state), ``final.json`` (the global
step, the log history) and ``fetched.json`` (how many samples this process fetched
from the dataset, with 0 workers).

Under torchrun (``WORLD_SIZE`` > 1: DDP over gloo on CPU processes) each rank seeds
its own streams (``set_seed(seed + rank)``, as accelerate's ``device_specific``
seeding: each rank its own dropout masks, so a rank given another's RNG streams
would train otherwise) and writes its results as ``final-rank<R>.*`` and
``fetched-rank<R>.json``.
"""

import json
import multiprocessing
import os
import signal
import sys

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments, set_seed
from transformers.trainer_utils import get_last_checkpoint

cfg = json.loads(sys.argv[1])
RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
if cfg["mode"] == "snapd":
    from snapd_client.transformers import Trainer  # snapd
else:
    from transformers import Trainer


class Tokens(torch.utils.data.Dataset):
    """Generated token sequences: no hub, no network."""

    def __init__(self, n=96, length=16, vocab=64, seed=7):
        self.data = torch.randint(0, vocab, (n, length),
                                  generator=torch.Generator().manual_seed(seed))
        self.fetched = 0

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        self.fetched += 1   # the test's count of samples fetched (0 workers)
        return {"input_ids": self.data[i], "labels": self.data[i]}



# --- the test's hooks: kill points, each taken once ------------------------------------

def kill_once(kind, step):
    if [kind, step] in cfg.get("kills", []):
        mark = os.path.join(cfg["out"], f"killed-{kind}-{step}")
        if not os.path.exists(mark):
            open(mark, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def pause_once(step):
    """Every rank stops here and says so; the test SIGKILLs the whole job."""
    if ["pause", step] in cfg.get("kills", []):
        mark = os.path.join(cfg["out"], f"paused-{RANK}")
        if not os.path.exists(mark):
            open(mark + ".tmp", "w").close()
            os.replace(mark + ".tmp", mark)
            while True:
                signal.pause()


class Kills(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        kill_once("step_end", state.global_step)

    def on_substep_end(self, args, state, control, **kw):
        kill_once("substep", state.global_step)
        pause_once(state.global_step)

    def on_step_begin(self, args, state, control, **kw):
        kill_once("step_begin", state.global_step)


def killed_saving(save):
    def save_optimizer_and_scheduler(self, output_dir):
        kill_once("save", self.state.global_step)
        return save(self, output_dir)
    return save_optimizer_and_scheduler


Trainer._save_optimizer_and_scheduler = killed_saving(Trainer._save_optimizer_and_scheduler)
torch.set_num_threads(1)   # runs side by side on a small machine: no threads spinning

# --- the stock script ------------------------------------------------------------------

set_seed(42)
config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                    resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
model = GPT2LMHeadModel(config)
own = cfg["mode"] == "own"
args = TrainingArguments(
    output_dir=cfg.get("output_dir", cfg["out"]), run_name=cfg.get("run_name"),
    per_device_train_batch_size=4, gradient_accumulation_steps=2,
    num_train_epochs=cfg.get("epochs", 2), learning_rate=3e-3, weight_decay=0.01,
    lr_scheduler_type="cosine", warmup_steps=4, logging_steps=5, seed=42,
    eval_strategy="steps", eval_steps=4, per_device_eval_batch_size=8,
    save_strategy="steps" if own else "no", save_steps=cfg.get("save_steps", 3),
    dataloader_num_workers=cfg.get("workers", 0), use_cpu=True, report_to="none",
    disable_tqdm=True, **cfg.get("args", {}))
train = Tokens()
trainer = Trainer(model=model, args=args, train_dataset=train,
                  eval_dataset=Tokens(n=16, seed=8), callbacks=[Kills()])
if WORLD > 1:
    set_seed(args.seed + args.process_index)   # each rank its own dropout masks
resume = own and get_last_checkpoint(args.output_dir) is not None
trainer.train(resume_from_checkpoint=True if resume else None)

# --- what the test compares ------------------------------------------------------------


def result(name, ext):
    """``out/name.ext``, or ``out/name-rank<R>.ext`` on many ranks."""
    return os.path.join(cfg["out"], f"{name}-rank{RANK}.{ext}" if WORLD > 1 else
                        f"{name}.{ext}")


tensors = {f"model.{k}": v.detach().clone() for k, v in model.named_parameters()}  # tied once
for p, state in trainer.optimizer.state_dict()["state"].items():
    for k, v in state.items():
        tensors[f"optimizer.{p}.{k}"] = torch.as_tensor(v).detach().contiguous()
save_file(tensors, result("final", "safetensors"))
with open(result("fetched", "json"), "w") as f:
    json.dump(train.fetched, f)
with open(result("final", "json"), "w") as f:
    json.dump({"global_step": trainer.state.global_step,
               "log_history": trainer.state.log_history[:-1]}, f)
if WORLD > 1:   # every rank's results written before any rank leaves
    torch.distributed.barrier()
    if multiprocessing.current_process().name == "MainProcess":
        # A worker of its own interpreter leaves without tearing the process groups
        # down, as tests/multirank/dump.py's leave_job: gloo's teardown may abort.
        # A worker torchrun forked (--run-path) returns to torchrun, which waits for
        # its return and ends it without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
