"""Every RNG stream captured, digested, refused when missing, and restored exactly."""

import random
import warnings

import numpy as np
import pytest
import torch

from snapd.errors import CorruptSnapshot, IncompatibleState, InvalidOption, MissingRngStream
from snapd_client import Client, FallbackWarning
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
    with pytest.raises(InvalidOption, match="gen:g") as info:
        rng.add_generator("g", torch.Generator())
    assert isinstance(info.value, ValueError) and info.value.field == "gen:g"


def test_a_stream_the_snapshot_lacks_is_missing_not_corrupt():
    rng = RngStreams()
    state = rng.capture()
    rng.add_generator("late", torch.Generator())   # tracked after the snapshot
    with pytest.raises(MissingRngStream) as info:
        rng.check(state, source="snap/manifest.snapd")
    assert isinstance(info.value, IncompatibleState)
    assert (info.value.path, info.value.field) == ("snap/manifest.snapd", "rng.gen:late")
    assert "_omit=['rng:gen:late']" in str(info.value)
    rng.check(state, source="snap/manifest.snapd", omit=["gen:late"])


def test_a_cpu_snapshot_on_a_gpu_host_says_how_to_resume(monkeypatch):
    rng = RngStreams()
    state = rng.capture()   # no cuda:N in it: a CPU-only run's
    monkeypatch.setattr(rng, "names", lambda: ["python", "numpy", "torch", "cuda:0"])
    with pytest.raises(MissingRngStream, match="CUDA_VISIBLE_DEVICES") as info:
        rng.check(state, source="snap/manifest.snapd")
    assert info.value.field == "rng.cuda:0" and "0 CUDA device(s)" in str(info.value)


def test_restore_stops_at_a_missing_stream_without_falling_back(tmp_path):
    root = str(tmp_path / "root")
    first = Client(root, "run", daemon=False)
    first.track(model=torch.nn.Linear(2, 2))
    for step in (1, 2):
        first.snapshot(step).wait()
    first.close()
    again = Client(root, "run", daemon=False)
    again.track(model=torch.nn.Linear(2, 2), noise=torch.Generator())
    newest = again.store.snapshot_path(again.store.committed()[-1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(MissingRngStream) as info:
            again.restore()
    assert not [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert info.value.path.startswith(newest) and info.value.field == "rng.gen:noise"
    assert again.restore(_omit=["rng:gen:noise"]) == 2   # the way the message names
    again.close()
