"""The Hugging Face ``Trainer`` with snapd: exact, non-blocking, crash-safe resume.

::

    from snapd_client.transformers import Trainer   # was: from transformers import Trainer

    trainer = Trainer(model=model, args=args, train_dataset=data)   # unchanged
    trainer.train()   # resumes from the newest snapshot by itself

Why a subclass and not a ``TrainerCallback``: the Trainer decides how many epochs and
batches to skip from ``resume_from_checkpoint`` inside ``_inner_training_loop``,
before any callback runs, and keeps the answer in local variables; the optimizer
and the scheduler are created after that. A callback can restore the weights, but
not make the loop start where the snapshot was. The subclass feeds the Trainer's own
resume path (its skip of consumed batches by sampler index, without fetching them,
and its RNG resynchronisation after the skip) from a snapshot instead of a
``checkpoint-N`` folder, and overrides only small methods:

- ``_init_training_state`` (the loop asks it where to start): the optimizer is
  created here, as ``_prepare_for_training`` would create it first thing, and
  ``Client.restore()`` puts back the model, the optimizer, the scheduler's state,
  the ``TrainerState`` (global step, epoch, log history, stateful callbacks), the
  loop's logging accumulators, the sampler's seed and every RNG stream; the epoch and
  the batches consumed in it follow from the global step, as in the Trainer's resume.
- ``create_scheduler``: the scheduler is made after ``accelerator.prepare``, as
  always; the restored state is loaded into it then.
- ``_run_epoch`` / ``_load_rng_state``: the resumed epoch skips its consumed batches
  through ``accelerate.skip_first_batches`` (indices only), and the RNG streams are
  set to the snapshot's again where the Trainer resynchronises them (after the first
  window's batches are fetched, or at the top of an epoch).
- ``_maybe_log_save_evaluate``: at the end of every optimizer step, after logging,
  evaluation and the Trainer's own save, a state-log record, then ``snapshot()``,
  which returns once the state is copied into snapd's staging memory; the daemon
  writes it in the background. So snapshots are taken at accumulation boundaries
  (a kill mid-accumulation recomputes the window). At an epoch's last step the
  snapshot waits for the epoch's end (its ``on_epoch_end``, and the evaluation and
  save that follow), so that a resume there starts the next epoch as the
  uninterrupted run did.

Several ranks (``torchrun``): each rank's ``train()`` makes its own client, which
takes its rank from the process group ``TrainingArguments`` set up; each rank writes
its own part of every snapshot and a snapshot is committed once every part is
durable (docs/multirank.md). Under torchrun accelerate shards the training loader:
a ``BatchSamplerShard`` deals each rank its batches of one seeded shuffle, the same
number on every rank, so the global step gives every rank's position, and the skip
above skips the rank's own consumed batches. The model is tracked bare (accelerate
wraps it in DDP after restore() ran), so each part holds the whole model and
optimizer state.

Exactness needs the sampler to shuffle from its own seed, not from the global RNG
at the epoch's start: accelerate's ``SeedableRandomSampler``
(``accelerator_config.use_seedable_sampler``, the Trainer's default) or a sequential
order. Other configurations the Trainer's loop handles differently (DeepSpeed, FSDP,
SageMaker MP, ``auto_find_batch_size``) are refused with ``UnsupportedState``.
docs/frameworks.md, "The Hugging Face Trainer" has the measured comparison with the Trainer's own
``resume_from_checkpoint``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import warnings
from typing import Any, Dict, Optional

import torch

try:
    import transformers
    from transformers.trainer_callback import ExportableState, TrainerCallback, TrainerState
except ImportError as e:   # the optional extra is missing: say which line installs it
    raise ImportError(f"snapd_client.transformers needs the Hugging Face Trainer ({e}); "
                      "install it with: pip install 'snapd[transformers]'") from e

from snapd.errors import InvalidOption, UnsupportedState
from snapd_client.client import Client

__all__ = ["Trainer"]

# The Trainer's methods this module overrides, with the parameters it relies on: the
# ones of transformers 5.24. Another version may have moved them; refuse at import
# rather than resume on another path.
_RELIED_ON = {"_init_training_state": ("max_steps", "num_update_steps_per_epoch",
                                       "resume_from_checkpoint"),
              "_run_epoch": ("epoch", "resume_from_checkpoint", "epochs_trained"),
              "_load_rng_state": ("checkpoint",), "create_scheduler": ("num_training_steps",),
              "_maybe_log_save_evaluate": ("grad_norm", "learning_rate")}


def _check_trainer_version() -> None:
    for name, params in _RELIED_ON.items():
        method = getattr(transformers.Trainer, name, None)
        have = inspect.signature(method).parameters if callable(method) else {}
        if not all(p in have for p in params):
            raise UnsupportedState(
                f"transformers {transformers.__version__}: Trainer.{name} is not the one "
                "snapd_client.transformers extends (parameters "
                f"{', '.join(params)}); install the version snapd[transformers] names "
                "(transformers 5.24)", field="transformers")


_check_trainer_version()

# What ``_run_epoch`` gets as ``resume_from_checkpoint`` in the resumed epoch: it
# makes the Trainer skip the consumed batches, and ``_load_rng_state`` recognise it.
SNAPSHOT_MARK = "snapd:snapshot"


class _Pending:
    """A tracked state whose live object comes later or lives elsewhere: restore()
    keeps the loaded state in ``loaded`` for the trainer to apply at the right time."""

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer
        self.loaded: Optional[Dict[str, Any]] = None

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.loaded = dict(state)

    def take(self) -> Optional[Dict[str, Any]]:
        loaded, self.loaded = self.loaded, None
        return loaded


class SchedulerState(_Pending):
    """The learning-rate scheduler's state. The Trainer creates the scheduler after
    ``accelerator.prepare``, later than restore() runs, so it is loaded then."""

    def state_dict(self) -> Dict[str, Any]:
        scheduler = self.trainer.lr_scheduler
        if scheduler is None:   # before the first train() made it: nothing yet
            return dict(self.loaded or {})
        return scheduler.state_dict()


class TrainerStateRecord(_Pending):
    """The ``TrainerState`` as the JSON the Trainer writes to ``trainer_state.json``
    (floats round-trip exactly through ``json``), with every stateful callback's
    state taken now, as ``_save_checkpoint`` does."""

    def state_dict(self) -> Dict[str, Any]:
        trainer = self.trainer
        fields = dataclasses.asdict(trainer.state)
        callbacks = dict(fields.get("stateful_callbacks") or {})
        for cb in trainer.callback_handler.callbacks + [trainer.control]:
            if isinstance(cb, ExportableState):
                callbacks[type(cb).__name__] = cb.state()
        fields["stateful_callbacks"] = callbacks
        return {"json": json.dumps(fields, sort_keys=True)}


class LoopValues(_Pending):
    """The loop's logging accumulators, which ``_inner_training_loop`` resets after
    restore() ran: put back at ``on_train_begin`` so that the logged losses of the
    resumed run are the uninterrupted run's too."""

    def state_dict(self) -> Dict[str, Any]:
        t = self.trainer
        tr_loss = getattr(t, "_tr_loss", None)
        return {"tr_loss": tr_loss.detach().cpu().clone() if tr_loss is not None
                else torch.zeros(()),
                "total_loss_scalar": float(getattr(t, "_total_loss_scalar", 0.0)),
                "globalstep_last_logged": int(getattr(t, "_globalstep_last_logged", 0)),
                "current_flos": float(getattr(t, "current_flos", 0.0))}


class SamplerSeed(_Pending):
    """The training sampler's seed: accelerate's ``SeedableRandomSampler`` shuffles
    epoch ``e`` from ``initial_seed + e``; the epoch comes from the global step."""

    def state_dict(self) -> Dict[str, Any]:
        sampler = self.trainer._snapd_sampler
        return {"initial_seed": getattr(sampler, "initial_seed", None)}


class _Boundaries(TrainerCallback):
    """Tells the trainer whether ``_maybe_log_save_evaluate`` is called at a step's
    end or at an epoch's end, and puts the loop's values back when training begins."""

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._snapd_loop_values()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._snapd_at_epoch_end = False

    def on_epoch_end(self, args, state, control, **kwargs):
        self.trainer._snapd_at_epoch_end = True


def _unwrapped(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (or itself)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def train_sampler(loader: Any) -> Any:
    """The index sampler under a (prepared) training loader, or None."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for owner in (batch_sampler, getattr(batch_sampler, "batch_sampler", None)):
        sampler = getattr(owner, "sampler", None)
        if sampler is not None:
            return sampler
    return getattr(loader, "sampler", None)


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` whose ``train()`` snapshots through snapd and resumes
    from the newest snapshot by itself (this module's docstring says how).

    ``snapd_root`` (default ``<output_dir>/snapd``) and ``snapd_run`` (default
    ``TrainingArguments.run_name``, else ``"trainer"``) name the run;
    ``snapd_options``: keyword arguments of :class:`snapd_client.Client` (``every``,
    ``keep_last``, ``mode``, ``data_version`` ...). Every other argument is the
    Trainer's. ``train(resume_from_checkpoint=...)`` is refused: it resumes from
    snapd by itself.
    """

    def __init__(self, *args: Any, snapd_root: Optional[str] = None,
                 snapd_run: Optional[str] = None,
                 snapd_options: Optional[Dict[str, Any]] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._snapd_root = snapd_root or os.path.join(self.args.output_dir, "snapd")
        self._snapd_run = snapd_run or self.args.run_name or "trainer"
        self._snapd_options = dict(snapd_options or {})
        self._snapd: Optional[Client] = None
        self._snapd_sampler: Any = None
        self._snapd_rng: Optional[Dict[str, bytes]] = None   # the snapshot's streams
        self._snapd_resumed_epoch: Optional[int] = None
        self._snapd_steps_per_epoch = 0
        self._snapd_last_step = -1   # the last step logged and offered to snapshot()
        self._snapd_at_epoch_end = False
        self._snapd_states = {"lr_scheduler": SchedulerState(self),
                              "trainer_state": TrainerStateRecord(self),
                              "loop": LoopValues(self), "sampler": SamplerSeed(self)}
        self.add_callback(_Boundaries(self))

    @property
    def snapd(self) -> Optional[Client]:
        """The client of the current ``train()`` call (None outside one)."""
        return self._snapd

    # --- train(): one client per call ------------------------------------------------

    def train(self, resume_from_checkpoint: Any = None, trial: Any = None,
              ignore_keys_for_eval: Any = None, **kwargs: Any):
        if resume_from_checkpoint not in (None, False):
            raise InvalidOption(
                f"train(resume_from_checkpoint={resume_from_checkpoint!r}): this Trainer "
                f"resumes from the newest snapshot under {self._snapd_root} by itself; "
                "drop the argument (or use transformers.Trainer to resume from a "
                "checkpoint folder)", field="resume_from_checkpoint")
        self._check_supported()
        self._snapd = Client(self._snapd_root, self._snapd_run, **self._snapd_options)
        self._snapd_last_step, self._snapd_resumed_epoch = -1, None
        try:
            result = super().train(None, trial, ignore_keys_for_eval, **kwargs)
        except BaseException:
            try:
                self._snapd.close()
            except Exception as closing:   # the training error is raised; this one said
                warnings.warn(f"snapd: closing run {self._snapd_run} after train() "
                              f"failed also failed: {closing!r}", stacklevel=2)
            raise
        finally:
            client, self._snapd = self._snapd, None
        client.close()   # waits until every snapshot handed off is durable
        return result

    def _check_supported(self) -> None:
        refused = [(self.is_deepspeed_enabled, "deepspeed"),
                   (self.is_fsdp_enabled or self.is_fsdp_xla_enabled, "fsdp"),
                   (self.args.auto_find_batch_size, "auto_find_batch_size")]
        for on, field in refused:
            if on:
                raise UnsupportedState(
                    f"TrainingArguments.{field} is set: snapd_client.transformers.Trainer "
                    "creates the optimizer before accelerator.prepare, which this mode "
                    f"does differently; unset {field}, or use transformers.Trainer",
                    field=field)

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        sampler = train_sampler(loader)
        if getattr(sampler, "generator", False) is None \
                and not hasattr(sampler, "initial_seed"):
            raise UnsupportedState(
                f"the training sampler ({type(sampler).__name__}) draws each epoch's "
                "shuffle from the global RNG at the epoch's start, which a resume "
                "mid-epoch cannot redraw; set TrainingArguments(accelerator_config="
                "{'use_seedable_sampler': True}) (the default)",
                field="accelerator_config.use_seedable_sampler")
        self._snapd_sampler = sampler
        return loader

    # --- restore: where the loop asks where to start ------------------------------

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs,
                             resume_from_checkpoint, trial):
        start = super()._init_training_state(max_steps, num_update_steps_per_epoch,
                                             num_train_epochs, resume_from_checkpoint, trial)
        self._snapd_steps_per_epoch = num_update_steps_per_epoch
        client = self._snapd
        if client is None:   # train() of transformers.Trainer called on this object
            return start
        self.create_optimizer()   # what _prepare_for_training creates first; kept there
        client.track(model=self.model, optimizer=_unwrapped(self.optimizer),
                     scaler=getattr(self.accelerator, "scaler", None), **self._snapd_states)
        step = client.restore()
        if client.restored is None:
            return start
        self._apply_trainer_state(max_steps, num_train_epochs, trial)
        sampler_state = self._snapd_states["sampler"].take() or {}
        if sampler_state.get("initial_seed") is not None:
            self._snapd_sampler.initial_seed = int(sampler_state["initial_seed"])
        self._snapd_rng = client.rng.capture()   # set again after the skip's fetches
        self._snapd_last_step = step
        epochs = step // num_update_steps_per_epoch
        self._snapd_resumed_epoch = epochs
        consumed = 0 if self.args.ignore_data_skip else \
            (step % num_update_steps_per_epoch) * self.args.gradient_accumulation_steps
        return epochs, consumed

    def _apply_trainer_state(self, max_steps, num_train_epochs, trial) -> None:
        """As the Trainer's resume: the saved state, the callbacks' states, then the
        references of this run (max steps, epochs, process flags)."""
        loaded = self._snapd_states["trainer_state"].take()
        self.state = TrainerState(**json.loads(loaded["json"]))
        self._load_callback_state()
        self.state.init_training_references(self, max_steps, num_train_epochs, trial)

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None):
        loaded = self._snapd_states["lr_scheduler"].take()
        if not loaded:
            return super().create_scheduler(num_training_steps, optimizer)
        # A new scheduler sets the groups' lr (and some their momentum) for step 0;
        # the restored optimizer's groups hold the snapshot's values: keep those.
        groups = _unwrapped(optimizer or self.optimizer).param_groups
        restored = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        scheduler.load_state_dict(loaded)
        for group, values in zip(groups, restored):
            group.update(values)
        return scheduler

    def _snapd_loop_values(self) -> None:
        loaded = self._snapd_states["loop"].take()
        if loaded:
            self._tr_loss = loaded["tr_loss"].to(self.args.device)
            self._total_loss_scalar = float(loaded["total_loss_scalar"])
            self._globalstep_last_logged = int(loaded["globalstep_last_logged"])
            self.current_flos = float(loaded["current_flos"])

    def _run_epoch(self, *args: Any, **kwargs: Any):
        if self._snapd_resumed_epoch is not None and kwargs.get("epoch") == \
                self._snapd_resumed_epoch and kwargs.get("resume_from_checkpoint") is None:
            kwargs["resume_from_checkpoint"] = SNAPSHOT_MARK
        return super()._run_epoch(*args, **kwargs)

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        if checkpoint == SNAPSHOT_MARK:
            self._snapd.rng.restore(self._snapd_rng)
            return
        super()._load_rng_state(checkpoint)

    # --- snapshot: at the end of each optimizer step ---------------------------------

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, trial, epoch,
                                 ignore_keys_for_eval, start_time, learning_rate=None,
                                 **kwargs: Any):
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, trial, epoch,
                                         ignore_keys_for_eval, start_time,
                                         learning_rate=learning_rate, **kwargs)
        client, step = self._snapd, self.state.global_step
        if client is None or step <= self._snapd_last_step:
            return   # an epoch's end right after a step already taken care of
        last_of_epoch = self._snapd_steps_per_epoch and \
            step % self._snapd_steps_per_epoch == 0
        if last_of_epoch and not self._snapd_at_epoch_end:
            return   # taken at the epoch's end, after what the epoch's end does
        self._snapd_last_step = step
        scalars = {} if learning_rate is None else {"lr": float(learning_rate)}
        if grad_norm is not None:
            scalars["grad_norm"] = float(grad_norm)
        client.log(step, **scalars)
        client.snapshot(step)
