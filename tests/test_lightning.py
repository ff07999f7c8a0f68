"""SnapdCallback in this process (snapshots written here, no daemon: the unit lane's
SNAPD_DAEMON=0): a fit stopped at a step boundary and fitted again by a new trainer,
module and loader resumes onto the uninterrupted fit bit for bit; what the cursor
cannot follow is refused at on_fit_start, naming the field; the stock script adds
at most three lines. The SIGKILL trials are tests/integration/test_lightning_resume.py.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

pl = pytest.importorskip("lightning.pytorch")

from snapd.errors import UnsupportedState  # noqa: E402
from snapd_client.lightning import SnapdCallback  # noqa: E402

JOB = os.path.join(os.path.dirname(__file__), "integration", "lightning_job.py")


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ValidatedNet(Net):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)


class Stream(IterableDataset):
    def __iter__(self):
        return iter([(torch.zeros(4), 0)] * 8)


def data(n=36):
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))


def fit(root, max_steps, callback=True, loaders=None, extra=(), ckpt_path=None, val=None,
        module=None, **trainer_kw):
    """A fresh seed, module, loader and trainer, as a new process would make them;
    Lightning's own ModelCheckpoint saves beside."""
    pl.seed_everything(7, verbose=False)
    model = (module or Net)()
    loader = loaders if loaders is not None else DataLoader(data(), batch_size=4, shuffle=True)
    trainer = pl.Trainer(max_steps=max_steps, max_epochs=-1, accumulate_grad_batches=2,
                         accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root,
                         callbacks=[Counter(), *extra] + ([SnapdCallback(root, run="fit", every=1)]
                                                          if callback else []),
                         **trainer_kw)
    trainer.fit(model, loader, val, ckpt_path=ckpt_path)
    return model, trainer


class Counter(pl.Callback):
    """A callback with state of its own: the batches it has seen."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.batches = state["batches"]


def states(model, trainer):
    opt = trainer.optimizers[0].state_dict()["state"]
    sched = trainer.lr_scheduler_configs[0].scheduler.state_dict()
    tensors = [*model.state_dict().values(), *(v for s in opt.values() for v in s.values())]
    return tensors, sched, trainer.callbacks[0].batches


def test_a_fit_fitted_again_resumes_onto_the_uninterrupted_fit(tmp_path, caplog):
    """Seven updates, then a new fit to twelve. 9 batches an epoch, 5 updates (after
    batches 1, 3, 5, 7 and 8): the stop lands mid-epoch 1 and the resumed fit
    crosses into epoch 2."""
    root = str(tmp_path / "root")
    whole = states(*fit(str(tmp_path / "other"), 12, callback=False))
    fit(root, 7)
    with caplog.at_level(logging.INFO, logger="snapd_client"):
        model, trainer = fit(root, 12)
    assert "run fit: resuming from step 7" in caplog.text
    snapd_callback = [c for c in trainer.callbacks if isinstance(c, SnapdCallback)][0]
    assert snapd_callback.resumed_from == 7 and trainer.global_step == 12
    # a callback's own state came back through Lightning's connector
    assert trainer.callbacks[0].batches == whole[2] == 22   # 9 + 9 + 4
    tensors, sched, _ = states(model, trainer)
    assert sched == whole[1]
    assert len(tensors) == len(whole[0])
    for got, want in zip(tensors, whole[0]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("loaders, field", [
    pytest.param(lambda: [DataLoader(data(), batch_size=4)] * 2, "train_dataloaders",
                 id="two-loaders"),
    pytest.param(lambda: DataLoader(Stream(), batch_size=4), "train_dataloaders",
                 id="unsized"),
])
def test_what_the_cursor_cannot_follow_is_refused(tmp_path, loaders, field):
    with pytest.raises(UnsupportedState) as caught:
        fit(str(tmp_path / "root"), 4, loaders=loaders())
    assert caught.value.field == field
    assert "SnapdCallback" in str(caught.value)


def test_reloading_the_loader_every_epoch_is_refused(tmp_path):
    with pytest.raises(UnsupportedState) as caught:
        fit(str(tmp_path / "root"), 4, reload_dataloaders_every_n_epochs=1)
    assert caught.value.field == "reload_dataloaders_every_n_epochs"
    assert "set it to 0" in str(caught.value)


@pytest.mark.parametrize("make", [
    pytest.param(lambda: DataLoader(data(), batch_size=4, shuffle=True,
                                    generator=torch.Generator().manual_seed(5)),
                 id="loader-generator"),
    pytest.param(lambda: StatefulDataLoader(data(), batch_size=4, shuffle=True),
                 id="stateful-dataloader"),
])
def test_a_loader_with_a_generator_of_its_own_fits_as_without_the_callback(tmp_path, make):
    """The callback sets the loader up early; the draws that makes from the loader's
    own generator (torchdata's sampler always has one) are undone as the global ones."""
    def made():   # torchdata's sampler seeds its generator from torch's when built
        torch.manual_seed(11)
        return make()

    stock = states(*fit(str(tmp_path / "stock"), 6, callback=False, loaders=made()))
    with_callback = states(*fit(str(tmp_path / "root"), 6, loaders=made()))
    assert with_callback[1] == stock[1]
    for got, want in zip(with_callback[0], stock[0]):
        assert torch.equal(got, want)


def test_a_lightning_checkpoint_without_a_snapshot_is_refused(tmp_path):
    """fit(ckpt_path=...) where the run has no snapshot yet: Lightning's checkpoint
    holds no RNG state and no data position, so the fit is refused, naming the file."""
    root = str(tmp_path / "root")
    saves = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "lightning"), save_last=True,
                                         save_top_k=0, every_n_train_steps=1)
    fit(root, 2, callback=False, extra=[saves])
    last = str(tmp_path / "lightning" / "last.ckpt")
    assert os.path.exists(last)
    with pytest.raises(UnsupportedState) as caught:
        fit(root, 4, ckpt_path=last)
    assert caught.value.field == "ckpt_path" and caught.value.path == last
    assert "Drop ckpt_path" in str(caught.value)


def test_a_shuffled_validation_loader_is_refused_before_training(tmp_path):
    """Refused at the sanity check's validation, before the first training batch."""
    with pytest.raises(UnsupportedState) as caught:
        fit(str(tmp_path / "root"), 4, module=ValidatedNet,
            val=DataLoader(data(8), batch_size=4, shuffle=True))
    assert caught.value.field == "val_dataloaders"
    assert "shuffle=False" in str(caught.value)


def test_the_stock_script_adds_at_most_three_lines():
    with open(JOB) as f:
        added = [line for line in f if line.rstrip().endswith("# snapd")]
    assert 1 <= len(added) <= 3, added
