"""Every RNG stream captured, digested, refused when missing, and restored exactly."""

import random

import numpy as np
import pytest
import torch

from snapd.errors import CorruptSnapshot
from snapd_client.rng import RngStreams


def draws(gen):
    return (random.random(), random.gauss(0, 1), float(np.random.rand()),
            float(np.random.randn()), torch.rand(3).tolist(),
            torch.rand(2, generator=gen).tolist())


def test_capture_restore_reproduces_every_stream():
    gen = torch.Generator().manual_seed(5)
    rng = RngStreams()
    rng.add_generator("noise", gen)
    random.gauss(0, 1)  # leaves a cached gaussian in the python state
    np.random.randn()   # and in numpy's
    state = rng.capture()
    assert set(state) == {"python", "numpy", "torch", "gen:noise"}
    first = draws(gen)
    rng.restore(state)
    assert draws(gen) == first


def test_omitting_a_stream_leaves_it_running_on():
    rng = RngStreams()
    state = rng.capture()
    first = draws(torch.Generator())
    rng.restore(state, omit=["numpy"])
    again = draws(torch.Generator())
    assert again[0] == first[0] and again[2] != first[2]


def test_digests_change_with_the_stream_and_only_it():
    rng = RngStreams()
    rng.add_generator("g", torch.Generator().manual_seed(1))
    before = rng.live_digests()
    np.random.rand()
    after = rng.live_digests()
    assert before["numpy"] != after["numpy"]
    assert {k: v for k, v in before.items() if k != "numpy"} == \
        {k: v for k, v in after.items() if k != "numpy"}


def test_live_digests_equal_digests_of_a_capture():
    rng = RngStreams()
    rng.add_generator("g", torch.Generator().manual_seed(1))
    np.random.randn()
    assert rng.live_digests() == rng.digests(rng.capture())


def test_missing_stream_is_refused_by_name():
    rng = RngStreams()
    state = rng.capture()
    del state["numpy"]
    with pytest.raises(CorruptSnapshot, match=r"rng\.numpy") as info:
        rng.check(state, source="snap/manifest.snapd")
    assert info.value.field == "rng.numpy"


def test_same_name_for_two_generators_is_an_error():
    rng = RngStreams()
    rng.add_generator("g", torch.Generator())
    with pytest.raises(ValueError, match="gen:g"):
        rng.add_generator("g", torch.Generator())
