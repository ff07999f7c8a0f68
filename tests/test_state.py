"""Flattening state dicts into skeleton + tensors and back, without pickle."""

from collections import OrderedDict

import numpy as np
import pytest
import torch

from snapd.errors import CorruptSnapshot, UnsupportedState
from snapd.skeleton import unflatten
from snapd_client.state import flatten, tensor_meta


def roundtrip(state):
    flat = flatten(state, "obj")
    return flat, unflatten(flat.skeleton, flat.tensors, source="test")


def test_optimizer_state_roundtrips_with_tuples_and_int_keys():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), betas=(0.8, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = opt.state_dict()
    flat, back = roundtrip(state)
    assert back["param_groups"][0]["betas"] == (0.8, 0.95)
    assert isinstance(back["param_groups"][0]["betas"], tuple)
    assert set(back["state"]) == {0, 1}
    for k in (0, 1):
        for name, value in state["state"][k].items():
            assert torch.equal(back["state"][k][name], value)
    assert len(flat.tensors) == 6


def test_module_state_keeps_order_and_type():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    state = model.state_dict()
    _, back = roundtrip(state)
    assert isinstance(back, OrderedDict)
    assert list(back) == list(state)


def test_plain_leaves_of_every_supported_kind():
    state = {"none": None, "flag": True, "f": 1.5, "big": (1 << 63) + 5, "neg": -3,
             "s": "x", "b": b"\x00\x01", "dtype": torch.bfloat16,
             "device": torch.device("cpu"), "np_scalar": np.float32(2.5),
             "np_int": np.int64(7), "np_f64": np.float64(0.25), "array": np.arange(6, dtype=np.int16).reshape(2, 3),
             "nested": [{"t": torch.arange(3)}, (1, [2, (3,)])], 7: "int key"}
    _, back = roundtrip(state)
    assert back["big"] == (1 << 63) + 5 and back["dtype"] is torch.bfloat16
    assert back["np_scalar"] == np.float32(2.5) and back["np_scalar"].dtype == np.float32
    assert back["np_int"].dtype == np.int64
    assert type(back["np_f64"]) is np.float64 and back["np_f64"] == 0.25
    assert isinstance(back["array"], np.ndarray) and back["array"].dtype == np.int16
    assert (back["array"] == state["array"]).all()
    assert back["nested"][1] == (1, [2, (3,)]) and back[7] == "int key"
    assert torch.equal(back["nested"][0]["t"], torch.arange(3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.bool,
                                   torch.complex64, torch.int8, torch.float64])
def test_tensor_leaves_keep_dtype_and_shape(dtype):
    t = torch.ones(2, 3).to(dtype)
    flat = flatten({"t": t, "scalar": torch.tensor(3.0)}, "obj")
    assert tensor_meta(flat) == [(".t", str(dtype)[6:], [2, 3]), (".scalar", "float32", [])]


@pytest.mark.parametrize("leaf", [object(), {1, 2}, lambda: 0, 1 << 65])
def test_unsupported_leaf_is_refused_with_its_path(leaf):
    with pytest.raises(UnsupportedState, match=r"obj\.inner\[1\]"):
        flatten({"inner": [0, leaf]}, "obj")


def test_skeleton_pointing_past_the_tensor_list_is_corrupt():
    flat = flatten({"a": torch.zeros(1), "b": torch.zeros(1)}, "obj")
    with pytest.raises(CorruptSnapshot, match="skeleton names tensor 1"):
        unflatten(flat.skeleton, flat.tensors[:1], source="test")


def test_garbage_skeleton_is_corrupt_not_executed():
    with pytest.raises(CorruptSnapshot, match="skeleton"):
        unflatten(b"\xc1\xc1\xc1", [], source="test")


def test_a_leaf_autograd_tracks_is_detached_and_the_others_are_taken_as_they_are():
    weight = torch.nn.Parameter(torch.randn(3))
    buffer = torch.randn(2)
    flat = flatten({"w": weight, "b": buffer}, "obj")
    assert not flat.tensors[0].requires_grad
    assert flat.tensors[0].data_ptr() == weight.data_ptr()   # a view, not a copy
    assert flat.tensors[1] is buffer
    assert flat.leaves == [weight, buffer]


def test_tensor_indices_stay_right_past_any_earlier_flatten():
    flatten({"a": torch.zeros(1), "b": torch.ones(1)}, "small")
    state = {f"t{i}": torch.full((1,), float(i)) for i in range(300)}
    _, back = roundtrip(state)
    assert [float(back[f"t{i}"]) for i in range(300)] == [float(i) for i in range(300)]


def test_a_dtype_without_a_name_is_refused_every_time():
    # float8_e4m3fnuz has no name in the format (snapd/format.py ITEMSIZES)
    for _ in range(2):
        with pytest.raises(CorruptSnapshot, match="float8_e4m3fnuz has no snapd encoding"):
            flatten({"t": torch.zeros(2, dtype=torch.float8_e4m3fnuz)}, "obj")
