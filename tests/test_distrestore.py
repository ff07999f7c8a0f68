"""Restoring a multi-rank snapshot, the parts that need no process: the overlap
arithmetic of resharding, the DDP prefix, reading parts (refs, shards) and the
agreement of every rank on one candidate, over a fake collective of threads."""

import os
import threading
import warnings

import pytest
import torch

import snapd.errors
from helpers import ThreadCollective, assert_equal, flip_byte, read_manifest
from snapd.errors import CorruptSnapshot, IncompatibleState, ReplayDivergence
from snapd.logwriter import LogWriter
from snapd.options import Options
from snapd.plan import ObjectPlan, SnapshotPlan, TensorSource
from snapd.store import RunStore
from snapd.writer import write_snapshot
from snapd_client import reshard
from snapd_client.agreement import agree
from snapd_client.capture import tensor_bytes
from snapd_client.client import Client
from snapd_client.distrestore import Parts, deferred_read, prepare
from snapd_client.journal import Journal
from snapd_client.restore import FallbackWarning, ddp_prefix, type_name, with_prefix
from snapd_client.rng import RngStreams
from snapd_client.state import flatten


# --- overlap arithmetic ---------------------------------------------------------------

def _even_boxes(shape, parts, dim=0):
    step = shape[dim] // parts
    out = []
    for i in range(parts):
        offset = [0] * len(shape)
        offset[dim] = i * step
        size = list(shape)
        size[dim] = step
        out.append((tuple(offset), tuple(size)))
    return out


def _slice(t, box):
    for d, (o, n) in enumerate(zip(*box)):
        t = t.narrow(d, o, n)
    return t


@pytest.mark.parametrize("shape", [[16], [8, 6]])
@pytest.mark.parametrize("saved_n,now_n", [(4, 2), (2, 4)])
def test_overlaps_rebuild_each_new_piece_from_the_saved_ones(shape, saved_n, now_n):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    saved = _even_boxes(shape, saved_n)
    data = {i: _slice(full, b).clone() for i, b in enumerate(saved)}
    for want in _even_boxes(shape, now_n):
        copies = reshard.overlaps("w", shape, saved, want, source="x")
        got = reshard.assemble(want[1], full.dtype, data, copies)
        assert torch.equal(got, _slice(full, want))
        assert len(copies) == (saved_n // now_n if saved_n > now_n else 1)


def test_overlaps_of_a_2d_tensor_sharded_on_its_second_dim_into_the_first():
    full = torch.arange(48.).reshape(6, 8)
    saved = _even_boxes([6, 8], 4, dim=1)
    data = {i: _slice(full, b).clone() for i, b in enumerate(saved)}
    want = ((3, 0), (3, 8))
    copies = reshard.overlaps("w", [6, 8], saved, want, source="x")
    assert torch.equal(reshard.assemble(want[1], full.dtype, data, copies), full[3:])


def test_pieces_that_leave_a_hole_are_refused_naming_the_tensor():
    saved = _even_boxes([8], 4)[:3]   # the last quarter is missing
    with pytest.raises(CorruptSnapshot, match=r"objects.model.w cover 2 of the 4"):
        reshard.overlaps("objects.model.w", [8], saved, ((4,), (4,)), source="/s/rank-1")


# --- the DDP prefix ------------------------------------------------------------------

def test_ddp_prefix_is_decided_on_the_whole_key_set():
    assert ddp_prefix(["module.a", "module.b"], ["a", "b"]) == "strip"
    assert ddp_prefix(["a", "b"], ["module.a", "module.b"]) == "add"
    assert ddp_prefix(["a", "b"], ["a", "b"]) is None
    # A model whose own submodule is called "module": nothing is renamed.
    assert ddp_prefix(["module.a", "b"], ["a", "b"]) is None


def test_with_prefix_renames_keys_and_metadata_both_ways():
    bare = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    wrapped = _Wrapper(bare)
    added = with_prefix(bare.state_dict(), "add")
    assert list(added) == list(wrapped.state_dict())
    assert added._metadata["module.1"] == wrapped.state_dict()._metadata["module.1"]
    stripped = with_prefix(wrapped.state_dict(), "strip")
    assert list(stripped) == list(bare.state_dict())
    assert set(stripped._metadata) == set(bare.state_dict()._metadata)
    bare.load_state_dict(stripped)


class _Wrapper(torch.nn.Module):
    """Keys like DistributedDataParallel's (``module.<key>``), without a process group."""

    def __init__(self, module):
        super().__init__()
        self.module = module


@pytest.mark.parametrize("saved_wrapped", [True, False])
def test_warm_start_loads_weights_across_the_ddp_prefix(tmp_path, saved_wrapped):
    torch.manual_seed(0)
    source = torch.nn.Linear(3, 2)
    with Client(str(tmp_path), "a", daemon=False) as c:
        c.track(model=_Wrapper(source) if saved_wrapped else source)
        c.snapshot(1)
    target = torch.nn.Linear(3, 2)
    with Client(str(tmp_path), "a", daemon=False) as c:
        c.track(model=target if saved_wrapped else _Wrapper(target))
        assert c.restore(mode="warm_start") == 0
    assert torch.equal(target.weight, source.weight)
    assert torch.equal(target.bias, source.bias)


# --- reading parts --------------------------------------------------------------------

def _write_parts(root, world, states, placements, step=5, name="model",
                 like=torch.nn.Linear(1, 1)):
    """One part per rank, committed globally by the last: ``states[r]`` is rank r's
    state dict of object ``name`` (of ``like``'s type), ``placements[r]`` its
    path -> {"shard"/"ref"}."""
    store = RunStore(str(root), "r")
    store.ensure()
    rng = RngStreams().capture()
    for rank in range(world):
        flat = flatten(states[rank], name)
        tensors = [TensorSource(p, str(t.dtype).split(".")[1], list(t.shape),
                                tensor_bytes(t), **placements[rank].get(p, {}))
                   for p, t in zip(flat.paths, flat.tensors)]
        plan = SnapshotPlan(run="r", step=step, lineage={"id": 0, "mode": "fresh",
                                                        "parent": None},
                            objects=[ObjectPlan(name, type_name(like), flat.skeleton,
                                                tensors)],
                            rng=rng, rank=rank, world_size=world, session="s")
        write_snapshot(store, plan, Options())
    return store.snapshot_path(store.committed()[-1])


def test_a_sharded_snapshot_loads_as_full_tensors_into_an_unsharded_model(tmp_path):
    weight, bias = torch.randn(4, 3), torch.randn(4)
    states, placements = [], []
    for r in range(4):  # the weight row-sharded on 4 ranks; the bias written by rank 0
        states.append({"weight": weight[r:r + 1].clone(), "bias": bias.clone()})
        placements.append({".weight": {"shard": {"global_shape": [4, 3], "offset": [r, 0]}},
                           **({".bias": {"ref": 0}} if r else {})})
    path = _write_parts(tmp_path, 4, states, placements)
    model = torch.nn.Linear(3, 4)
    got = prepare(Parts(path), 1, 2, {"model": model}, RngStreams(), data_version=None,
                  stream=None, omit=set())
    assert got.mode == "reshard" and got.old_world == 4 and got.rng == {}
    assert torch.equal(got.states["model"]["weight"], weight)
    assert torch.equal(got.states["model"]["bias"], bias)


def test_same_world_size_reads_a_replicated_tensor_from_the_part_that_stores_it(tmp_path):
    weight = torch.randn(2, 2)
    states = [{"weight": weight.clone(), "bias": torch.zeros(2)}] * 2
    path = _write_parts(tmp_path, 2, states, [{}, {".weight": {"ref": 0}}])
    got = prepare(Parts(path), 1, 2, {"model": torch.nn.Linear(2, 2)}, RngStreams(),
                  data_version=None, stream=None, omit=set())
    assert got.mode == "resume"
    assert torch.equal(got.states["model"]["weight"], weight)


def test_a_flipped_byte_in_the_part_that_stores_a_replicated_tensor_is_caught(tmp_path):
    states = [{"weight": torch.randn(64, 64), "bias": torch.zeros(64)}] * 2
    path = _write_parts(tmp_path, 2, states, [{}, {".weight": {"ref": 0}}])
    tensor_file = next((tmp_path / "r" / "snapshots").glob("*/rank-00000/model.tensors"))
    data = bytearray(tensor_file.read_bytes())
    data[5000] ^= 0xFF
    tensor_file.write_bytes(bytes(data))
    with pytest.raises(CorruptSnapshot) as caught:
        prepare(Parts(path), 1, 2, {"model": torch.nn.Linear(64, 64)}, RngStreams(),
                data_version=None, stream=None, omit=set())
    assert "rank-00000" in caught.value.path


# --- restore(overlap=True) after a reshard: the optimizer's moments read later ----------

def _adam_sharded_on_4(tmp_path):
    """Adam's state of a Linear(3, 4) saved by 4 ranks: each moment of the weight
    row-sharded (rank r holds row r), the bias's moments and every ``step`` written
    by rank 0 (the others refer to it). The full moments and the snapshot's path."""
    full = {key: torch.randn(shape) for key, shape in (
        ("w_avg", (4, 3)), ("w_sq", (4, 3)), ("b_avg", (4,)), ("b_sq", (4,)))}
    groups = [{"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0,
               "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
               "differentiable": False, "fused": None, "params": [0, 1]}]
    states, placements = [], []
    for r in range(4):
        states.append({"state": {
            0: {"step": torch.tensor(7.0), "exp_avg": full["w_avg"][r:r + 1].clone(),
                "exp_avg_sq": full["w_sq"][r:r + 1].clone()},
            1: {"step": torch.tensor(7.0), "exp_avg": full["b_avg"].clone(),
                "exp_avg_sq": full["b_sq"].clone()}}, "param_groups": groups})
        shard = {"shard": {"global_shape": [4, 3], "offset": [r, 0]}}
        placements.append({".state.0.exp_avg": shard, ".state.0.exp_avg_sq": shard,
                           **({p: {"ref": 0} for p in (".state.0.step", ".state.1.step",
                              ".state.1.exp_avg", ".state.1.exp_avg_sq")} if r else {})})
    path = _write_parts(tmp_path, 4, states, placements, name="optimizer",
                        like=torch.optim.Adam(torch.nn.Linear(3, 4).parameters()))
    return full, path


def _prepare_adam(path, defer=()):
    opt = torch.optim.Adam(torch.nn.Linear(3, 4).parameters(), lr=0.01)
    got = prepare(Parts(path), 1, 2, {"optimizer": opt}, RngStreams(), data_version=None,
                  stream=None, omit=set(), defer=defer)
    return opt, got


def test_a_reshard_with_overlap_reads_the_moments_later_as_a_reshard_without(tmp_path):
    full, path = _adam_sharded_on_4(tmp_path)
    _, whole = _prepare_adam(path)
    opt, got = _prepare_adam(path, defer={"optimizer"})
    assert got.mode == "reshard" and got.deferred == ("optimizer",)
    assert got.states["optimizer"]["state"] == {}   # restore read the param_groups only
    assert got.states["optimizer"]["param_groups"] == whole.states["optimizer"]["param_groups"]
    later = deferred_read(Parts(path), 1, {"optimizer": opt}, got.deferred)()
    assert list(later) == ["optimizer"]
    assert_equal(later["optimizer"], whole.states["optimizer"], "resharded moments")
    moments = later["optimizer"]["state"]   # the weight's rows from the 4 parts, whole
    assert torch.equal(moments[0]["exp_avg"], full["w_avg"])
    assert torch.equal(moments[0]["exp_avg_sq"], full["w_sq"])
    assert torch.equal(moments[1]["exp_avg"], full["b_avg"])


def test_a_flipped_byte_in_one_saved_shard_fails_the_later_read_naming_its_file(tmp_path):
    _, path = _adam_sharded_on_4(tmp_path)
    part = os.path.join(path, "rank-00002")
    entry = read_manifest(part)["objects"]["optimizer"]
    damaged = os.path.join(part, entry["file"])
    moment = next(t for t in entry["tensors"] if t["path"] == ".state.0.exp_avg")
    flip_byte(damaged, moment["chunks"][0][0] + 3)   # this rank's row of the weight's
    opt, got = _prepare_adam(path, defer={"optimizer"})   # restore reads no moment
    with pytest.raises(CorruptSnapshot) as caught:
        deferred_read(Parts(path), 1, {"optimizer": opt}, got.deferred)()
    assert caught.value.path == damaged and damaged in str(caught.value)


# --- agreement over a fake collective ----------------------------------------------------



def _agree_all(world, fails, order=("b", "a")):
    """Run agree() on ``world`` threads; ``fails[(rank, name)]`` is what that rank's
    read of that candidate raises. Returns each rank's result (or error), and the
    FallbackWarnings of all ranks (caught here: catch_warnings is per process)."""
    threads, out = ThreadCollective(world), [None] * world

    def one(rank):
        def try_one(name):
            if (rank, name) in fails:
                raise fails[(rank, name)]
            return f"{name}@{rank}"
        try:
            out[rank] = agree(threads.member(rank), lambda: {
                "order": list(order), "passed_over": None, "session": "0123abcd"},
                try_one, "/snaps")
        except Exception as e:
            out[rank] = e

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        workers = [threading.Thread(target=one, args=(r,)) for r in range(world)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(20)
    return out, [str(w.message) for w in seen if w.category is FallbackWarning]


def test_every_rank_takes_the_first_candidate_when_all_read_it():
    out, warned = _agree_all(3, {})
    assert not warned
    for got in out:
        assert got.name == "b" and got.session == "0123abcd"


def test_a_damaged_part_on_one_rank_makes_every_rank_fall_back_and_names_it():
    bad = CorruptSnapshot("/r/snapshots/b/rank-00001/model.bin: checksum mismatch",
                          path="/r/snapshots/b/rank-00001/model.bin", field="xxh3")
    out, warned = _agree_all(3, {(1, "b"): bad})
    assert len(warned) == 3   # one per rank
    assert all("rank 1" in w and "rank-00001/model.bin" in w for w in warned)
    for rank, got in enumerate(out):
        assert got.name == "a" and got.prepared == f"a@{rank}"
        assert "rank 1" in got.refused["b"]


def test_no_candidate_left_raises_the_same_error_on_every_rank():
    bad = CorruptSnapshot("damaged", path="/p", field="xxh3")
    out, _ = _agree_all(2, {(0, "b"): bad, (1, "a"): bad})
    messages = {str(got) for got in out}
    assert all(isinstance(got, CorruptSnapshot) for got in out)
    assert len(messages) == 1 and "rank 0" in messages.pop()


def test_a_snapshot_that_does_not_fit_on_one_rank_stops_every_rank():
    out, _ = _agree_all(2, {(1, "b"): IncompatibleState("shape differs", path="/p",
                                                        field="objects.model.w")})
    assert all(isinstance(got, IncompatibleState) for got in out)
    assert "rank 1" in str(out[0]) and out[0].field == "objects.model.w"


def test_restore_before_the_process_group_is_refused(tmp_path, monkeypatch):
    if not hasattr(snapd.errors, "DistributedNotReady"):
        pytest.skip("DistributedNotReady lands with the capture side of issue 14")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with Client(str(tmp_path), "a", daemon=False) as c:
        with pytest.raises(snapd.errors.DistributedNotReady,
                           match="WORLD_SIZE.*init_process_group"):
            c.restore()


def test_a_replay_divergence_on_a_rank_of_many_names_the_rank(tmp_path):
    store = RunStore(str(tmp_path), "r")
    store.ensure()
    rng = RngStreams()
    with LogWriter(store.path, 1, flush_interval=None) as w:
        for step in range(1, 4):
            w.append({"kind": "step", "step": step, "time": 1.0, "cursor": None,
                      "rng": rng.live_digests(), "scalars": {"loss": 1.0}})
    journal = Journal(store, 1, rng, Options(replay_check="raise"))
    journal.world_size = 2
    assert journal.begin_replay(1, 3) == 2
    with pytest.raises(ReplayDivergence, match=r"^replay check on rank 1: step 2 differs"):
        journal.step(2, None, {"loss": 2.0})
    journal.close()


def test_rank_0_failing_to_list_the_snapshots_stops_every_rank():
    threads, out = ThreadCollective(2), [None] * 2

    def one(rank):
        def listing():
            raise OSError("snapshots: permission denied")
        try:
            agree(threads.member(rank), listing, lambda name: name, "/snaps")
        except Exception as e:
            out[rank] = e

    workers = [threading.Thread(target=one, args=(r,)) for r in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(20)
    assert all(isinstance(e, snapd.errors.SnapdError) and "permission denied" in str(e)
               for e in out)
