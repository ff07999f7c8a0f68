"""PyTorch Lightning: exact resume from one callback.

::

    from snapd_client.lightning import SnapdCallback
    trainer = Trainer(..., callbacks=[SnapdCallback("checkpoints", run="exp1", every=50)])
    trainer.fit(model, loader)      # resumes by itself from the newest snapshot

Lightning's own checkpoint holds the module, optimizers, schedulers, the precision
plugin's state, the loops' progress and the callbacks' state, but no RNG stream and,
for a plain ``DataLoader``, no data position: a resume mid-epoch draws other dropout
masks and another shuffle. The callback keeps a :class:`~snapd_client.client.Client`
for the fit and gives it all of it:

- the module, each optimizer and each scheduler are tracked as themselves
  (``module``, ``optimizer``, ``optimizer_1``, ..., ``scheduler``, ...);
- the rest of Lightning's checkpoint (``dump_checkpoint()`` without what is tracked
  above and without the hyper-parameters, which the script builds again) is tracked
  as ``lightning`` (:class:`LightningState`);
- the training loader is iterated through the client's data cursor
  (:class:`EpochLoader` over :class:`~snapd_client.cursor.BatchStream`), so a resume
  skips the consumed batches without fetching them and every RNG stream is captured.

**When.** A snapshot is offered at ``on_train_batch_end`` after each optimizer step,
never inside a gradient-accumulation window (there the gradients are half summed),
with ``step = trainer.global_step``; ``every`` decides which are taken. At that hook
Lightning's loops are in the state its own ``ModelCheckpoint(every_n_train_steps=)``
saves, a restart point its loops know how to continue from. Not at an epoch's last
batch when the fit validates inside its epochs (``val_check_interval``): a restart
there skips the validation that follows, and the seed its loader draws.

**Resume.** In ``on_fit_start`` (after the strategy made the optimizers, before
Lightning restores any training state) the callback sets the loader up, then
``restore()`` puts back the tracked objects, every RNG stream and the cursor; the
saved loop state is handed to Lightning's checkpoint connector as the checkpoint it
loaded, so Lightning's own ``restore_training_state`` (precision plugin, loops,
optimizers, schedulers) runs on it right after the hook. Nothing between that hook
and the next training batch draws a random number (the sanity check runs inside
Lightning's ``isolate_rng``).

Why the loader is set up here: the cursor must be in place before the restore.
Lightning's ``setup_data`` calls ``iter()`` on the loader once, which draws a base
seed and starts workers; the callback runs it early, puts the global RNG streams
back as they were before it, and replaces the loader in Lightning's
``CombinedLoader`` by an :class:`EpochLoader`, whose ``iter()`` draws nothing until
its first batch. Each epoch's iterator is then opened from the same RNG as without
the callback, so adding it does not change the run. The generators of the loaders
handed to ``fit`` (a ``generator=``, torchdata's sampler's own) are put back with the
global streams; a loader that a ``train_dataloader()`` method builds is made inside
that set-up, and a generator of its own has drawn the early ``iter()``'s seed.

**ckpt_path.** ``fit(ckpt_path=...)`` loads Lightning's checkpoint before
``on_fit_start``; a snapshot's state then replaces all of it, and a run without a
snapshot is refused (the file holds no RNG stream and no data position).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Dict, Iterator, Optional

from torch.utils.data import RandomSampler

from snapd.errors import SnapdError, UnsupportedState
from snapd_client.client import Client
from snapd_client.cursor import BatchStream, private_generators
from snapd_client.rng import RngStreams
from snapd_client.values import ValueHome

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loops.fit_loop import RestartStage
    from lightning.pytorch.trainer import call
    from lightning.pytorch.utilities.warnings import PossibleUserWarning
except ImportError as e:   # the extra is missing: say which to install
    raise ImportError("snapd_client.lightning needs PyTorch Lightning: "
                      "pip install 'snapd[lightning]' (lightning>=2.6)") from e

try:   # torchdata's own sampler, the one a StatefulDataLoader(shuffle=True) has
    from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler
    _SHUFFLING: tuple = (RandomSampler, StatefulRandomSampler)
except ImportError:
    _SHUFFLING = (RandomSampler,)

logger = logging.getLogger(__name__)   # printed as "snapd: ..." (snapd/stderrlog.py)

# Keys of Lightning's checkpoint that the client tracks as objects of their own, or
# that the script builds again (hyper-parameters may hold any Python object).
_TRACKED_APART = ("state_dict", "optimizer_states", "lr_schedulers")
_REBUILT = ("hyper_parameters", "hparams_name", "hparams_type", "datamodule_hyper_parameters")
# What Lightning warns when its loops restart mid-epoch over a loader without
# state_dict(): true of its own checkpoints, not of a snapd resume (the cursor).
_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"


class LightningState(ValueHome):
    """The part of Lightning's checkpoint the client does not track as objects: the
    loops' progress, the callbacks' state, the precision plugin's (a grad scaler's),
    a datamodule's, and what the module's ``on_save_checkpoint`` adds.

    A value home: its contents change shape as training runs (the loops' logged
    results), so restore checks its type only. ``load_state_dict`` keeps the state for
    the checkpoint connector (:meth:`SnapdCallback.on_fit_start`)."""

    def __init__(self, trainer: "pl.Trainer") -> None:
        self.trainer = trainer
        self.loaded: Optional[Dict[str, Any]] = None

    def state_dict(self) -> Dict[str, Any]:
        checkpoint = self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        return {k: v for k, v in checkpoint.items()
                if k not in _TRACKED_APART and k not in _REBUILT}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.loaded = dict(state)


class EpochLoader:
    """The training loader as Lightning iterates it: each ``iter()`` is one epoch of
    the client's cursor, the rest of the current one where Lightning continues it
    (a resume mid-epoch), else the next one.

    Lightning ends an epoch by counting its batches, not by exhausting the iterator,
    and calls ``iter()`` again at each epoch's start; whether that start is a new
    epoch is read from its epoch loop at the first batch (by then a resume has put the
    loop's progress back). ``len()`` is the loader's: a sized loader keeps Lightning's
    data fetcher from fetching ahead, so the cursor counts only consumed batches."""

    def __init__(self, stream: BatchStream, trainer: "pl.Trainer") -> None:
        self.stream, self.trainer = stream, trainer

    @property
    def loader(self) -> Any:
        return self.stream.loader

    @property
    def dataset(self) -> Any:
        return getattr(self.stream.loader, "dataset", None)

    def __len__(self) -> int:
        return len(self.stream)

    def __iter__(self) -> Iterator:
        progress = self.trainer.fit_loop.epoch_loop.batch_progress.current
        if progress.ready == 0:   # a new epoch for Lightning: one for the cursor too
            self.stream.end_epoch()
        yield from self.stream


class SnapdCallback(Callback):
    """Snapshots a Lightning fit through snapd and resumes it exactly.

    ``root``, ``run``, ``data_version`` and ``client_options`` are the
    :class:`~snapd_client.client.Client`'s (``keep_last=3``, ``mode="overlap"``,
    ``daemon=False``, ...). ``every``: a snapshot every N optimizer steps (``"auto"``:
    as often as it pays; None: after every step). ``client`` is the fit's client
    between ``on_fit_start`` and the fit's end, ``resumed_from`` the step restored
    (0 on a fresh run).
    """

    def __init__(self, root: str, run: str, every: Any = None, *,
                 data_version: Optional[str] = None, **client_options: Any) -> None:
        self.root, self.run, self.every = root, run, every
        self.data_version, self.client_options = data_version, client_options
        self.client: Optional[Client] = None
        self.resumed_from: Optional[int] = None
        self._state: Optional[LightningState] = None
        self._quiet: Optional[tuple] = None   # the warnings filter of a resume
        self._offered: Optional[int] = None   # the step of the last snapshot offered
        self._restored = False   # this fit resumed from a snapshot

    # --- the fit's start: set up, restore ------------------------------------------

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        client = Client(self.root, self.run, data_version=self.data_version,
                        every=self.every, **self.client_options)
        self.client = client
        try:
            loader = self._training_loader(trainer)
            self._state = LightningState(trainer)
            client.track(module=pl_module, **_optimizers(trainer), **_schedulers(trainer),
                         lightning=self._state)
            stream = client.batches(loader)
            self._install(trainer, EpochLoader(stream, trainer))
            self.resumed_from = self._offered = client.restore()
            self._restored = client.restored is not None
            if self._restored:
                if trainer.ckpt_path:
                    logger.info(f"run {self.run}: the snapshot of step {self.resumed_from} "
                                f"replaces the training state of {trainer.ckpt_path} "
                                "(fit's ckpt_path)")
                self._hand_to_lightning(trainer, pl_module)
            elif trainer.ckpt_path:
                raise _checkpoint_without_snapshot(trainer.ckpt_path, self.run)
        except BaseException:
            self._close(raising=False)
            raise

    def _training_loader(self, trainer: "pl.Trainer") -> Any:
        """Lightning's training loader, set up now (its ``setup_data`` would do it
        after this hook; later calls find it done), its workers shut down again."""
        fit_loop = trainer.fit_loop
        if trainer.reload_dataloaders_every_n_epochs:
            raise UnsupportedState(
                "SnapdCallback: Trainer(reload_dataloaders_every_n_epochs="
                f"{trainer.reload_dataloaders_every_n_epochs}) replaces the training "
                "loader the data cursor iterates; set it to 0",
                field="reload_dataloaders_every_n_epochs")
        streams = RngStreams()   # the global streams: python, numpy, torch, cuda
        for i, generator in enumerate(_given_generators(fit_loop._data_source.instance)):
            streams.add_generator(f"loader.{i}", generator)   # a sampler's own, say
        before = streams.capture()
        fit_loop.setup_data()
        streams.restore(before)   # the early iter()'s draws undone
        combined = fit_loop._combined_loader
        if combined is None:
            raise UnsupportedState("SnapdCallback: the fit has no training loader "
                                   "(no training_step, or limit_train_batches=0)",
                                   field="train_dataloaders")
        if len(combined.flattened) != 1:
            raise UnsupportedState(
                f"SnapdCallback: the fit has {len(combined.flattened)} training loaders; "
                "the data cursor follows one. Combine them into one loader (one dataset)",
                field="train_dataloaders")
        loader = combined.flattened[0]
        try:
            len(loader)
        except TypeError as e:   # unsized: Lightning's fetcher would fetch ahead
            raise UnsupportedState(
                f"SnapdCallback: the training loader ({type(loader).__name__}) has no "
                "len(); the cursor needs a sized loader (a map-style dataset)",
                field="train_dataloaders") from e
        combined.reset()   # the workers setup_data started go; the cursor starts its own
        return loader

    def _install(self, trainer: "pl.Trainer", epochs: EpochLoader) -> None:
        """The cursor in the loader's place; the fetcher's iterator made again over it
        (it draws nothing now: EpochLoader opens an epoch at its first batch)."""
        fit_loop = trainer.fit_loop
        fit_loop._combined_loader.flattened = [epochs]
        fit_loop._data_fetcher.setup(fit_loop._combined_loader)
        iter(fit_loop._data_fetcher)

    def _hand_to_lightning(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule"
                           ) -> None:
        """The restored loop state, as the checkpoint Lightning's connector loaded:
        the module's and callbacks' load hooks run now, as for ``ckpt_path``; the
        precision plugin, loops, optimizers and schedulers after this hook (their
        entries are the restored objects' own states, loaded onto themselves)."""
        checkpoint = dict(self._state.loaded or {})
        checkpoint["state_dict"] = trainer.strategy.lightning_module_state_dict()
        checkpoint["optimizer_states"] = [trainer.strategy.optimizer_state(o)
                                          for o in trainer.optimizers]
        checkpoint["lr_schedulers"] = [c.scheduler.state_dict()
                                       for c in trainer.lr_scheduler_configs]
        connector = trainer._checkpoint_connector
        connector._loaded_checkpoint = checkpoint
        call._call_lightning_module_hook(trainer, "on_load_checkpoint", checkpoint)
        connector.restore_datamodule()
        connector.restore_callbacks()
        warnings.filterwarnings("ignore", message=_NOT_RESUMABLE, category=PossibleUserWarning)
        self._quiet = warnings.filters[0]   # taken out at the first batch

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """A resume from a snapshot taken at an epoch's last batch: Lightning's fit loop
        has just closed that epoch (its ``reset``), but still counts itself restarted
        mid-epoch, so it would open the next one without counting it as started and
        without ``on_train_epoch_start``; every later snapshot's loop state would be an
        epoch behind, and a resume from it would start its epoch over. The restart is
        over: the next epoch opens as in the uninterrupted fit."""
        fit_loop = trainer.fit_loop
        epochs = fit_loop.epoch_progress.total
        if self._restored and fit_loop.restarted_mid_epoch and \
                epochs.processed == epochs.started:
            fit_loop._restart_stage = RestartStage.NONE

    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule"
                            ) -> None:
        """A shuffled validation loader is refused at the first validation (the sanity
        check's, before any training, unless ``num_sanity_val_steps=0``): measured, a
        fit that validates with one does not resume exactly."""
        if self.client is None:
            return
        given = trainer.val_dataloaders
        loaders = given if isinstance(given, (list, tuple)) else [given]
        for loader in loaders:
            if isinstance(getattr(loader, "sampler", None), _SHUFFLING):
                self._close(raising=False)
                raise UnsupportedState(
                    "SnapdCallback: the validation loader shuffles (a RandomSampler); a "
                    "fit that validates with it does not resume exactly. Build it with "
                    "shuffle=False (Lightning warns against shuffling it too)",
                    field="val_dataloaders")

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                             batch: Any, batch_idx: int) -> None:
        self._unquiet()

    def _unquiet(self) -> None:
        quiet, self._quiet = self._quiet, None
        if quiet is not None and quiet in warnings.filters:
            warnings.filters.remove(quiet)
            # the module's cache of decisions is keyed on the filters' version
            getattr(warnings, "_filters_mutated", lambda: None)()

    # --- snapshots ------------------------------------------------------------------

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.client is None or trainer.fit_loop.epoch_loop._should_accumulate():
            return   # inside an accumulation window: no update has completed
        step = trainer.global_step
        if step == self._offered:   # no update since the last offer (manual optimization)
            return
        self._offered = step   # offered once, at the batch that stepped
        if _validates_inside_epochs(trainer) and \
                trainer.fit_loop.epoch_loop._num_ready_batches_reached():
            return   # a resume from here would skip the validation that follows
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        scalars = {"loss": float(loss)} if _one_number(loss) else {}
        self.client.log(step, **scalars)
        self.client.snapshot(step)

    # --- the end --------------------------------------------------------------------

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._close()

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                     exception: BaseException) -> None:
        self._close(raising=False)   # the fit's own exception is the one raised

    def _close(self, raising: bool = True) -> None:
        """Wait until every snapshot handed off is durable, and let the run go.
        ``raising=False``: a failed snapshot is logged, not raised, when another
        exception is on its way up."""
        self._unquiet()
        client, self.client = self.client, None
        if client is None:
            return
        try:
            client.close()
        except SnapdError as e:
            if raising:
                raise
            logger.info(f"run {self.run}: closed after the fit failed; {e}")


def _checkpoint_without_snapshot(ckpt_path: Any, run: str) -> UnsupportedState:
    """``fit(ckpt_path=...)`` on a run with no snapshot yet: Lightning has loaded its
    checkpoint, which holds no RNG stream and no data position, so the fit could not
    go on as the interrupted one would have, and the cursor would start its epochs
    over while Lightning's loops stand mid-fit. (With a snapshot, the snapshot's
    state replaces what Lightning loaded from the checkpoint.)"""
    return UnsupportedState(
        f"SnapdCallback: fit(ckpt_path={str(ckpt_path)!r}) loaded a Lightning checkpoint, "
        f"and run {run!r} has no snapd snapshot to resume from exactly (a Lightning "
        "checkpoint holds no RNG state and no data position). Drop ckpt_path to start "
        "the run over under snapd, or drop the SnapdCallback to continue from the "
        "checkpoint with Lightning's own resume",
        path=str(ckpt_path), field="ckpt_path")


def _given_generators(given: Any) -> list:
    """The private generators of the training loaders handed to ``fit`` (a loader's
    ``generator=``, torchdata's sampler's own): the early ``iter()`` draws from them
    too. A loader that ``train_dataloader()`` builds is made inside ``setup_data``,
    its generators out of reach until then."""
    loaders = list(given.values()) if isinstance(given, dict) else \
        list(given) if isinstance(given, (list, tuple)) else [given]
    found: list = []
    for loader in loaders:
        for generator in private_generators(loader):
            if not any(generator is g for g in found):
                found.append(generator)
    return found


def _validates_inside_epochs(trainer: "pl.Trainer") -> bool:
    """Does the fit validate by batch count or time inside its epochs
    (``val_check_interval``)? Then Lightning restarting from an epoch's last batch
    skips the validation that follows it, and with it the base seed that the
    validation loader's ``iter()`` draws: the resumed fit would go on from
    another RNG state. No snapshot is offered there."""
    every = trainer.val_check_batch
    return trainer.limit_val_batches != 0 and (
        every is None or every < trainer.num_training_batches)


def _optimizers(trainer: "pl.Trainer") -> Dict[str, Any]:
    return {("optimizer" if i == 0 else f"optimizer_{i}"): o
            for i, o in enumerate(trainer.optimizers)}


def _schedulers(trainer: "pl.Trainer") -> Dict[str, Any]:
    return {("scheduler" if i == 0 else f"scheduler_{i}"): c.scheduler
            for i, c in enumerate(trainer.lr_scheduler_configs)}


def _one_number(value: Any) -> bool:
    return hasattr(value, "numel") and value.numel() == 1
