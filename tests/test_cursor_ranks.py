"""The cursor in a job of many ranks: set_epoch before each epoch's iterator (resumed
epochs too), world and batch size in the state, and reshard_cursor's global count."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from snapd.errors import IncompatibleState
from snapd_client.cursor import BatchStream, check_cursor, reshard_cursor
from snapd_client.rng import RngStreams

N = 48


def loader(rank, world, batch):
    data = torch.arange(N)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=7)
    return DataLoader(data, batch_size=batch, sampler=sampler)


def epoch_batches(stream, count):
    return [next(stream).tolist() for _ in range(count)]


def test_each_epoch_is_shuffled_anew_and_a_resumed_epoch_too():
    stream = BatchStream(loader(0, 2, 4), RngStreams(), world_size=2)
    per_epoch = len(stream)
    first, second = epoch_batches(stream, per_epoch), epoch_batches(stream, 2)
    assert stream.loader.sampler.epoch == 1
    assert second != first[:2]            # without set_epoch epoch 1 repeats epoch 0
    state = stream.state()
    assert (state["world_size"], state["batch_size"]) == (2, 4)
    rest = epoch_batches(stream, 3)
    resumed = BatchStream(loader(0, 2, 4), RngStreams(), world_size=2)
    resumed.load(state)
    assert epoch_batches(resumed, 3) == rest


@pytest.mark.parametrize("old, new, index, want", [
    ((2, 4), (4, 2), 3, 3),      # same global batch: same index
    ((2, 4), (1, 8), 3, 3),
    ((4, 2), (2, 2), 3, 6),      # half the global batch: twice the batches
    ((2, 4), (3, 4), 4, 2),      # 32 consumed, 12 a step: floor
])
def test_reshard_keeps_the_global_count_of_samples(old, new, index, want):
    state = {"version": 1, "epoch": 2, "index": index, "epoch_rng": {"python": b"x"},
             "iter_rng": {}, "loader_state": None, "world_size": old[0],
             "batch_size": old[1]}
    out = reshard_cursor(state, new_world_size=new[0], new_batch_size=new[1])
    assert (out["epoch"], out["index"]) == (2, want)
    assert (out["world_size"], out["batch_size"]) == new
    assert out["epoch_rng"] == {} and out["iter_rng"] == {} and out["loader_state"] is None
    check_cursor(out, RngStreams(), source="test")   # a state load() accepts


def test_reshard_needs_the_batch_size():
    state = {"epoch": 0, "index": 2, "epoch_rng": {}, "world_size": 2, "batch_size": None}
    with pytest.raises(IncompatibleState) as info:
        reshard_cursor(state, new_world_size=1, new_batch_size=8)
    assert info.value.field == "cursor.batch_size"


def test_a_resharded_cursor_sees_the_rest_of_the_epoch_exactly_once():
    """2 ranks x 4 consumed 3 batches each; 1 rank x 8 goes on with the rest."""
    seen = []
    states = []
    for rank in (0, 1):
        stream = BatchStream(loader(rank, 2, 4), RngStreams(), world_size=2)
        seen += sum(epoch_batches(stream, 3), [])
        states.append(stream.state())
    new = reshard_cursor(states[0], new_world_size=1, new_batch_size=8)
    stream = BatchStream(loader(0, 1, 8), RngStreams(), world_size=1)
    stream.load(new)
    rest = sum(epoch_batches(stream, len(stream) - stream.index), [])
    assert sorted(seen + rest) == list(range(N))
