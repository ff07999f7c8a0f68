"""The batch stream resumes exactly: the same batches and the same RNG streams as the
uninterrupted run, across later epoch boundaries, for every kind of loader.

Each resume happens as in a new process would: a fresh loader built the same way, a
fresh stream, every RNG stream scrambled, then the snapshot's RNG and cursor restored.
Cursor states go through msgpack on the way, as they do on disk.
"""

import random

import msgpack
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from snapd.errors import CorruptSnapshot, IncompatibleState
from snapd_client.cursor import BatchStream, from_plain, to_plain
from snapd_client.rng import RngStreams

# torchdata 0.11 calls a deprecated torch API in every StatefulDataLoader.__init__.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

SIZE, BATCH = 10, 3
PER_EPOCH = 4  # ceil(10 / 3): the last batch of each epoch is short
EPOCHS = 3


class Items(Dataset):
    """Sample i is [i], plus, when noisy, draws from the RNG streams of the process
    that fetches it (the main one with 0 workers, a worker's otherwise)."""

    def __init__(self, noisy=False):
        self.noisy, self.calls = noisy, 0

    def __len__(self):
        return SIZE

    def __getitem__(self, i):
        self.calls += 1
        if not self.noisy:
            return torch.tensor([float(i)])
        return torch.tensor([float(i), torch.rand(1).item(), random.random(), np.random.rand()])


class Stream(IterableDataset):
    def __iter__(self):
        return iter([torch.tensor([float(i)]) for i in range(SIZE)])


class Shuffled:
    """A bare re-iterable: each pass shuffles with Python's global generator."""

    def __iter__(self):
        order = list(range(SIZE))
        random.shuffle(order)
        return iter([torch.tensor(order[i:i + BATCH]) for i in range(0, SIZE, BATCH)])


def seed_all(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def make_loader(kind, workers=0, generator=False, persistent=False, noisy=False):
    if kind == "bare":
        return Shuffled()
    if kind == "iterable":
        return DataLoader(Stream(), batch_size=BATCH)
    cls = StatefulDataLoader if kind == "stateful" else DataLoader
    gen = torch.Generator().manual_seed(123) if generator else None
    return cls(Items(noisy), batch_size=BATCH, shuffle=True, num_workers=workers,
               generator=gen, persistent_workers=persistent)


def build(seed, fast_forward="skip", **loader_kw):
    seed_all(seed)
    loader = make_loader(**loader_kw)
    rng = RngStreams()
    return BatchStream(loader, rng, fast_forward=fast_forward), rng


def train_step(batch):
    """What a step keeps: its batch and one draw from each global stream."""
    return batch.clone(), torch.rand(1), random.random(), float(np.random.rand())


def tail():
    """Draws after the last step: the streams must run on identically."""
    return torch.rand(3), random.random(), float(np.random.rand(2).sum())


def assert_same(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, (tuple, list)):
            assert_same(x, y)
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f"item {i}: {x} != {y}"
        else:
            assert x == y, f"item {i}: {x} != {y}"


def via_msgpack(state):
    return msgpack.unpackb(msgpack.packb(state, use_bin_type=True), raw=False)


def run_endless(stream, rng, steps, snap_at=()):
    out, snaps = [], {}
    for k in range(steps):
        if k in snap_at:
            snaps[k] = (via_msgpack(stream.state()), rng.capture())
        out.append(train_step(next(stream)))
    return out + [tail()], snaps


def resume(snap, order="rng_first", **build_kw):
    """A fresh stream on a fresh loader, streams scrambled, then the snapshot restored."""
    stream, rng = build(seed=999, **build_kw)
    cursor, rng_state = snap
    if order == "rng_first":  # what Client.restore does
        rng.restore(rng_state)
        stream.load(cursor)
    else:
        stream.load(cursor)
        rng.restore(rng_state)
    return stream, rng


# A loader with workers forks its worker processes: those cases run in the
# integration lane, with every process-starting test (the 0-worker cases stay here).
FORKS = pytest.mark.integration

ENDLESS = [
    pytest.param(dict(kind="plain", noisy=True), id="plain-0w"),
    pytest.param(dict(kind="plain", noisy=True, generator=True), id="plain-0w-gen"),
    pytest.param(dict(kind="plain", workers=2), id="plain-2w", marks=FORKS),
    pytest.param(dict(kind="plain", workers=2, generator=True), id="plain-2w-gen", marks=FORKS),
    pytest.param(dict(kind="stateful", noisy=True), id="stateful-0w"),
    pytest.param(dict(kind="stateful", workers=2), id="stateful-2w", marks=FORKS),
    pytest.param(dict(kind="plain", noisy=True, fast_forward="replay"), id="plain-0w-replay"),
    pytest.param(dict(kind="stateful", noisy=True, fast_forward="replay"), id="stateful-0w-replay"),
    pytest.param(dict(kind="iterable"), id="iterable-dataset"),
    pytest.param(dict(kind="bare"), id="bare-reiterable"),
]


def mode_for(kind, fast_forward="skip", **_):
    if fast_forward == "replay" or kind in ("iterable", "bare"):
        return "replay"
    return "loader_state" if kind == "stateful" else "skip"


def position(consumed):
    """(epoch, index) after `consumed` next() calls: a used-up epoch stays current
    until the next call sees its end."""
    if consumed and consumed % PER_EPOCH == 0:
        return consumed // PER_EPOCH - 1, PER_EPOCH
    return divmod(consumed, PER_EPOCH)


@pytest.mark.parametrize("loader_kw", ENDLESS)
def test_endless_stream_resumes_bit_for_bit(loader_kw):
    # 0: before any batch; 2: mid epoch 0; 4: epoch 0 used up, StopIteration not yet
    # seen; 5: mid epoch 1. Each resume runs on across the later epoch boundaries.
    points = (0, 2, 4, 5) if not loader_kw.get("workers") else (4, 5)
    steps = EPOCHS * PER_EPOCH
    stream, rng = build(seed=0, **loader_kw)
    expected, snaps = run_endless(stream, rng, steps, snap_at=points)
    for k in points:
        again, rng2 = resume(snaps[k], **loader_kw)
        assert (again.epoch, again.index) == position(k)
        assert via_msgpack(again.state()) == snaps[k][0]  # a snapshot right after a resume
        assert again.last_fast_forward["mode"] == mode_for(**loader_kw)
        got, _ = run_endless(again, rng2, steps - k)
        assert_same(got, expected[k:])
        assert again.epoch == EPOCHS - 1 and again.index == PER_EPOCH


def test_load_then_rng_restore_works_too():
    stream, rng = build(seed=0, kind="plain", noisy=True, generator=True)
    expected, snaps = run_endless(stream, rng, 10, snap_at=(6,))
    again, rng2 = resume(snaps[6], order="load_first", kind="plain", noisy=True, generator=True)
    assert_same(run_endless(again, rng2, 4)[0], expected[6:])


def run_drop_in(stream, rng, snap_after=()):
    """The drop-in loop. Snapshots: ('in', e, i) after batch i of epoch e, inside the
    loop; ('end', e) after epoch e's loop has finished."""
    seen, snaps = [], {}
    for epoch in range(stream.epoch, EPOCHS):
        for batch in stream:
            seen.append((epoch, stream.index, train_step(batch)))
            point = ("in", epoch, stream.index)
            if point in snap_after:
                snaps[point] = (via_msgpack(stream.state()), rng.capture(), len(seen))
        assert stream.epoch == epoch + 1 and stream.index == 0
        if ("end", epoch) in snap_after:
            snaps[("end", epoch)] = (via_msgpack(stream.state()), rng.capture(), len(seen))
    return seen + [tail()], snaps


DROP_IN = [
    pytest.param(dict(kind="plain", noisy=True), id="plain-0w"),
    pytest.param(dict(kind="plain", workers=2, persistent=True), id="plain-2w-persistent",
                 marks=FORKS),
    pytest.param(dict(kind="plain", workers=2, persistent=True, generator=True),
                 id="plain-2w-persistent-gen", marks=FORKS),
    pytest.param(dict(kind="stateful", workers=2, persistent=True), id="stateful-2w-persistent",
                 marks=FORKS),
]


@pytest.mark.parametrize("loader_kw", DROP_IN)
def test_drop_in_loop_resumes_bit_for_bit(loader_kw):
    # With persistent workers the iterator born in epoch 0 is reused by epoch 1: the
    # resume must not draw a second base seed there, in the loop or between epochs.
    points = {("in", 0, 2), ("in", 0, PER_EPOCH), ("end", 0), ("in", 1, 1), ("end", 1)}
    stream, rng = build(seed=0, **loader_kw)
    expected, snaps = run_drop_in(stream, rng, points)
    for point, (cursor, rng_state, done) in sorted(snaps.items(), key=str):
        again, rng2 = resume((cursor, rng_state), **loader_kw)
        got, _ = run_drop_in(again, rng2)
        assert_same(got, expected[done:])


def test_skip_positions_without_fetching():
    stream, rng = build(seed=0, kind="plain")
    expected, snaps = run_endless(stream, rng, 8, snap_at=(6,))
    again, rng2 = resume(snaps[6], kind="plain")
    assert again.loader.dataset.calls == 0
    assert again.last_fast_forward["mode"] == "skip" and again.last_fast_forward["batches"] == 2
    assert_same([train_step(next(again))], expected[6:7])
    assert again.loader.dataset.calls == BATCH


@FORKS
def test_replay_is_exact_when_workers_draw_and_skip_is_not():
    kw = dict(kind="plain", workers=2, noisy=True)
    stream, rng = build(seed=0, **kw)
    expected, snaps = run_endless(stream, rng, 2 * PER_EPOCH, snap_at=(2,))

    again, rng2 = resume(snaps[2], fast_forward="replay", **kw)
    assert again.last_fast_forward["mode"] == "replay" and again.last_fast_forward["batches"] == 2
    assert_same(run_endless(again, rng2, 2 * PER_EPOCH - 2)[0], expected[2:])

    # Negative control: skipping hands batch 2 to a freshly seeded worker, so the noise
    # drawn in workers differs for the rest of the epoch; the next epoch's workers are
    # seeded from the (restored) main streams again, so from there on it matches.
    skipped, rng3 = resume(snaps[2], **kw)
    got, _ = run_endless(skipped, rng3, 2 * PER_EPOCH - 2)
    first = got[0][0]
    assert torch.equal(first[:, 0], expected[2][0][:, 0])  # same samples
    assert not torch.equal(first, expected[2][0])          # different worker noise
    assert_same(got[2:], expected[PER_EPOCH:])


def test_state_is_plain_and_tensors_round_trip():
    stream, rng = build(seed=0, kind="stateful", workers=0)
    next(stream)
    state = stream.state()

    def plain(value):
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v) for k, v in value.items())
        if isinstance(value, list):
            return all(plain(v) for v in value)
        return value is None or isinstance(value, (bool, int, float, str, bytes))

    assert plain(state) and state["loader_state"] is not None
    for t in (torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), torch.tensor(True),
              torch.empty(0, 4), torch.tensor([1, 2], dtype=torch.int64)):
        back = from_plain(via_msgpack(to_plain({"t": (t, 1)})))
        assert torch.equal(back["t"][0], t) and back["t"][0].dtype == t.dtype
        assert back["t"][1] == 1


def test_bad_states_are_refused():
    stream, _ = build(seed=0, kind="plain")
    with pytest.raises(CorruptSnapshot):
        stream.load({"epoch": 0})
    with pytest.raises(CorruptSnapshot):
        stream.load({"epoch": -1, "index": 0, "epoch_rng": {}})
    with pytest.raises(CorruptSnapshot):
        stream.load({"epoch": 0, "index": 2, "epoch_rng": {}})
    plain, _ = build(seed=0, kind="plain", generator=True)
    next(plain)
    stateful, _ = build(seed=0, kind="stateful")
    with pytest.raises(IncompatibleState):
        stateful.load(plain.state())
    with pytest.raises(ValueError):
        BatchStream([], RngStreams(), fast_forward="seek")


def test_an_empty_loader_ends_the_endless_stream():
    stream = BatchStream([], RngStreams())
    with pytest.raises(StopIteration):
        next(stream)
    assert list(stream) == []


def test_len_is_the_loaders():
    stream, _ = build(seed=0, kind="plain")
    assert len(stream) == PER_EPOCH


@pytest.mark.parametrize("loader_kw", [
    pytest.param(dict(kind="plain", noisy=True), id="plain-0w"),
    pytest.param(dict(kind="plain", workers=2, persistent=True), id="plain-2w-persistent",
                 marks=FORKS),
    pytest.param(dict(kind="stateful", workers=2, persistent=True), id="stateful-2w-persistent",
                 marks=FORKS),
])
def test_load_on_a_used_stream_rewinds(loader_kw):
    # load() drops the live iterator (and its workers) whatever the stream has done since.
    stream, rng = build(seed=0, **loader_kw)
    first, snaps = run_endless(stream, rng, 10, snap_at=(5,))
    cursor, rng_state = snaps[5]
    rng.restore(rng_state)
    stream.load(cursor)
    assert_same(run_endless(stream, rng, 5)[0], first[5:])


def test_end_epoch_opens_the_next_epoch_as_a_pull_past_the_end_would():
    """A loop that counts its own batches (Lightning's) ends an epoch without asking
    for one more, or before the loader's end (a batch limit): end_epoch() goes on to
    the next epoch without fetching, and that epoch is the one a stream that ran to
    the end gets, with the RNG streams running on identically."""
    whole, _ = build(seed=5, kind="plain", noisy=True)
    ran = [train_step(next(whole)) for _ in range(PER_EPOCH)]   # epoch 0, used up
    ran += [train_step(next(whole)) for _ in range(PER_EPOCH)] + [tail()]
    counted, _ = build(seed=5, kind="plain", noisy=True)
    got = [train_step(next(counted)) for _ in range(PER_EPOCH)]
    counted.end_epoch()   # the used-up epoch's end, not pulled
    assert (counted.epoch, counted.index) == (1, 0)
    got += [train_step(next(counted)) for _ in range(PER_EPOCH)] + [tail()]
    assert_same(got, ran)
    limited, _ = build(seed=5, kind="plain")
    first = [next(limited) for _ in range(2)]   # a limit of 2 batches an epoch
    fetched = limited.loader.dataset.calls
    limited.end_epoch()
    assert limited.loader.dataset.calls == fetched and limited.epoch == 1
    assert len(first) == 2 and next(limited).shape == (BATCH, 1)
    limited.end_epoch()
    limited.end_epoch()   # an epoch not begun stays as it is
    assert (limited.epoch, limited.index) == (2, 0)
