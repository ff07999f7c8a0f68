"""The batch stream over a loader prepared by accelerate (``DataLoaderShard``, one
process) resumes exactly: the same batches and the same RNG streams as the
uninterrupted run, across later epoch boundaries, without fetching a consumed
sample; and ``track()`` takes the prepared optimizer as it is.

The shard is accelerate's own (``prepare_data_loader``, what ``Accelerator.prepare``
calls, with its defaults for one process). Each resume happens as in a new process
would: a fresh loader built the same way, every RNG stream scrambled, then the
snapshot's RNG and cursor restored; cursor states go through msgpack on the way.
"""

import random

import msgpack
import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader, Dataset

from snapd.errors import UnsupportedState
from snapd_client import Client
from snapd_client.cursor import BatchStream
from snapd_client.rng import RngStreams

# torchdata 0.11 calls a deprecated torch API in every StatefulDataLoader.__init__.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

SIZE, BATCH = 10, 3
PER_EPOCH = 4   # ceil(10 / 3)
EPOCHS = 3


@pytest.fixture(autouse=True)
def _accelerate_state():
    """accelerate's process-wide singletons, made here, gone after each test."""
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


class Items(Dataset):
    """Sample i is [i]; counts what it is asked for."""

    def __init__(self):
        self.calls = 0

    def __len__(self):
        return SIZE

    def __getitem__(self, i):
        self.calls += 1
        return torch.tensor([float(i)])


def seed_all(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def build(seedable=False, stateful=False, fast_forward="skip"):
    """A shuffled DataLoader prepared as ``Accelerator().prepare`` does for one
    process, and a stream over it; built from the same seed each time, as the same
    script would."""
    seed_all(0)
    loader = DataLoader(Items(), batch_size=BATCH, shuffle=True)
    shard = prepare_data_loader(loader, torch.device("cpu"), rng_types=["generator"],
                                use_seedable_sampler=seedable,
                                use_stateful_dataloader=stateful)
    rng = RngStreams()
    return BatchStream(shard, rng, fast_forward=fast_forward), rng


def via_msgpack(state):
    return msgpack.unpackb(msgpack.packb(state, use_bin_type=True), raw=False)


def run_endless(stream, rng, steps, snap_at=()):
    """Each step keeps its batch and one draw from each global stream."""
    out, snaps = [], {}
    for k in range(steps):
        if k in snap_at:
            snaps[k] = (via_msgpack(stream.state()), rng.capture())
        batch = next(stream)
        out.append((batch.clone(), torch.rand(1), random.random(), float(np.random.rand())))
    return out + [(torch.rand(3), random.random(), float(np.random.rand()))], snaps


def resume(snap, **build_kw):
    stream, rng = build(**build_kw)
    seed_all(999)   # the new process's streams, before the restore
    cursor, rng_state = snap
    rng.restore(rng_state)   # what Client.restore does: RNG first, then the cursor
    stream.load(cursor)
    return stream, rng


def assert_same(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, (tuple, list)):
            assert_same(x, y)
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f"item {i}: {x} != {y}"
        else:
            assert x == y, f"item {i}: {x} != {y}"


def position(consumed):
    if consumed and consumed % PER_EPOCH == 0:
        return consumed // PER_EPOCH - 1, PER_EPOCH
    return divmod(consumed, PER_EPOCH)


SHARDS = [
    pytest.param(dict(), "skip", id="shard"),
    pytest.param(dict(seedable=True), "skip", id="shard-seedable-sampler"),
    pytest.param(dict(fast_forward="replay"), "replay", id="shard-replay"),
]


@pytest.mark.parametrize("build_kw, mode", SHARDS)
def test_a_prepared_loader_resumes_bit_for_bit(build_kw, mode):
    # 0: before any batch; 2: mid epoch 0; 4: epoch 0 used up, its end not yet seen;
    # 5: mid epoch 1, where the shard's own epoch count (0 in a new process) must
    # not decide the shuffle of a seedable sampler.
    points = (0, 2, 4, 5)
    steps = EPOCHS * PER_EPOCH
    stream, rng = build(**build_kw)
    expected, snaps = run_endless(stream, rng, steps, snap_at=points)
    for k in points:
        again, rng2 = resume(snaps[k], **build_kw)
        assert (again.epoch, again.index) == position(k)
        assert via_msgpack(again.state())["epoch_rng"] == snaps[k][0]["epoch_rng"]
        assert again.last_fast_forward["mode"] == mode
        got, _ = run_endless(again, rng2, steps - k)
        assert_same(got, expected[k:])


def test_a_shard_over_a_stateful_loader_is_refused_naming_the_setting():
    with pytest.raises(UnsupportedState, match="use_stateful_dataloader") as caught:
        build(stateful=True)
    assert caught.value.field == "use_stateful_dataloader"


def test_the_consumed_batches_are_not_fetched():
    stream, rng = build()
    expected, snaps = run_endless(stream, rng, 8, snap_at=(6,))
    again, rng2 = resume(snaps[6])
    items = again.loader.dataset
    assert items.calls == 0 and again.last_fast_forward == {
        "mode": "skip", "batches": 2, "seconds": again.last_fast_forward["seconds"]}
    assert_same(run_endless(again, rng2, 2)[0], expected[6:])
    # The epoch's last two batches (3 samples, then 1), each fetched once.
    assert items.calls == 3 + 1


class Wrapper:
    """A wrapping loader that opens its base by ``iter()``, not by an explicit
    ``base_dataloader.__iter__()`` call: it cannot be handed a positioned iterator."""

    def __init__(self, base):
        self.base_dataloader = base

    def __len__(self):
        return len(self.base_dataloader)

    def __iter__(self):
        yield from iter(self.base_dataloader)


def test_a_wrapper_that_ignores_the_positioned_iterator_is_refused():
    def wrapped():
        seed_all(0)
        rng = RngStreams()
        return BatchStream(Wrapper(DataLoader(Items(), batch_size=BATCH, shuffle=True)),
                           rng), rng
    stream, rng = wrapped()
    _, snaps = run_endless(stream, rng, 3, snap_at=(2,))
    again, rng2 = wrapped()
    rng2.restore(snaps[2][1])
    again.load(snaps[2][0])
    with pytest.raises(UnsupportedState, match="fast_forward='replay'") as caught:
        next(again)
    assert caught.value.field == "fast_forward" and "Wrapper" in str(caught.value)


def prepared_training(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2),
                                torch.nn.Linear(8, 1))
    return Accelerator(cpu=True).prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def train(model, optimizer, steps):
    for _ in range(steps):
        model(torch.randn(5, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_track_takes_the_prepared_optimizer_as_it_is(tmp_path):
    """accelerate's AcceleratedOptimizer skips Optimizer.__init__ (no hook lists): it
    is tracked as the torch optimizer inside, whose state it only forwards."""
    model, optimizer = prepared_training(0)
    ckpt = Client(str(tmp_path), "run", daemon=False)
    ckpt.track(model=model, optimizer=optimizer)
    train(model, optimizer, 3)
    types = {o.name: o.type for o in ckpt.capture(3).objects}
    assert types["optimizer"] == "torch.optim.adamw.AdamW"
    ckpt.snapshot(3).wait()
    ckpt.close()
    saved = optimizer.state_dict()

    model2, optimizer2 = prepared_training(1)
    again = Client(str(tmp_path), "run", daemon=False)
    again.track(model=model2, optimizer=optimizer2)
    assert again.restore() == 3
    restored = optimizer2.state_dict()
    assert restored["param_groups"] == saved["param_groups"]
    for p, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(restored["state"][p][key], value), (p, key)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    again.close()


def test_an_optimizer_wrapper_with_state_of_its_own_is_tracked_as_it_is(tmp_path):
    class Averaging(torch.optim.SGD):   # its own state, beside the optimizer it holds
        def __init__(self, params, inner):
            super().__init__(params, lr=0.1)
            self.optimizer = inner

    params = [torch.nn.Parameter(torch.ones(2))]
    own = Averaging(params, torch.optim.SGD(params, lr=0.1))
    ckpt = Client(str(tmp_path), "run", daemon=False)
    ckpt.track(optimizer=own)
    types = {o.name: o.type for o in ckpt.capture(0).objects}
    assert types["optimizer"].endswith("Averaging")
    ckpt.close()
