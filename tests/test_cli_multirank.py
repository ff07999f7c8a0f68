"""The operator commands on multi-rank snapshots, in-process (click's CliRunner).

A two-rank snapshot is written here as the daemon would (one SnapshotPlan per rank
through snapd.writer.write_snapshot, the last part committing globally): a model
saved wrapped in DistributedDataParallel and its AdamW state, both replicated and
stored once (the model by rank 0, the optimizer by rank 1), and a table sharded by
rows over the ranks.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

from snapd.cli import main
from snapd.format import dtype_name
from snapd.logwriter import LogWriter
from snapd.options import Options
from snapd.plan import ObjectPlan, SnapshotPlan, TensorSource
from snapd.store import RunStore, SnapshotId
from snapd.writer import write_snapshot
from snapd_client.state import flatten

from helpers import flip_byte

RUN = "job"
DDP = "torch.nn.parallel.distributed.DistributedDataParallel"
LINEAGE = {"id": 0, "mode": "fresh", "parent": None}
TABLE = torch.arange(32, dtype=torch.float32).reshape(8, 4)


def bare_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))


def trained():
    """A model and its AdamW after two updates: the state a DDP job would save."""
    model = bare_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
    return model, opt


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def replicated(name: str, type_: str, state, rank: int, owner: int) -> ObjectPlan:
    """An object the same on every rank, stored by ``owner``; the others refer to it."""
    flat = flatten(state, name)
    tensors = [TensorSource(p, dtype_name(t.dtype), list(t.shape), _raw(t)) if rank == owner
               else TensorSource(p, dtype_name(t.dtype), list(t.shape), memoryview(b""),
                                 ref=owner)
               for p, t in zip(flat.paths, flat.tensors)]
    return ObjectPlan(name, type_, flat.skeleton, tensors)


def sharded_table(rank: int, world: int) -> ObjectPlan:
    rows = TABLE.shape[0] // world
    local = TABLE[rank * rows:(rank + 1) * rows]
    flat = flatten({"weight": local}, "table")
    piece = TensorSource(".weight", "float32", list(local.shape), _raw(local),
                         shard={"global_shape": list(TABLE.shape), "offset": [rank * rows, 0]})
    return ObjectPlan("table", "__main__.Table", flat.skeleton, [piece])


def plan(rank: int, world: int, step: int, model, opt, session: str = "s") -> SnapshotPlan:
    ddp_state = {f"module.{k}": v for k, v in model.state_dict().items()}
    objects = [replicated("model", DDP, ddp_state, rank, owner=0),
               replicated("optim", "torch.optim.adamw.AdamW", opt.state_dict(), rank,
                          owner=1 % world),
               sharded_table(rank, world)]
    return SnapshotPlan(RUN, step, LINEAGE, objects, rng={"torch": bytes([rank]) * 8},
                        rank=rank, world_size=world, session=session, metric=0.25)


def write_job(root: str, step: int, model, opt, ranks=(0, 1), world: int = 2) -> str:
    store = RunStore(root, RUN)
    for rank in ranks:
        write_snapshot(store, plan(rank, world, step, model, opt), Options())
    return store.snapshot_path(SnapshotId(0, step))


@pytest.fixture
def job(tmp_path):
    """A root with a committed 2-rank snapshot at step 10 and rank 1's part of step 20."""
    model, opt = trained()
    root = str(tmp_path / "root")
    path = write_job(root, 10, model, opt)
    write_job(root, 20, model, opt, ranks=(1,))
    return {"root": root, "path": path, "model": model, "opt": opt}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_ls_shows_the_world_size_all_bytes_and_the_incomplete_parts(job):
    result = cli("ls", RUN, "--root", job["root"], "--json")
    out = json.loads(result.output)
    [row] = out["snapshots"]
    parts = [os.path.join(job["path"], d) for d in ("rank-00000", "rank-00001")]
    on_disk = sum(os.path.getsize(os.path.join(p, n)) for p in parts for n in os.listdir(p)
                  if n.endswith(".tensors"))
    assert (row["name"], row["world_size"], row["bytes"]) == ("00000010", 2, on_disk)
    [waiting] = out["incomplete"]
    assert (waiting["name"], waiting["ranks"], waiting["missing"]) == ("00000020", [1], [0])
    text = cli("ls", RUN, "--root", job["root"]).output
    assert "00000020 INCOMPLETE: ranks 1 of 2 present, missing 0" in text
    assert "Never restored; snapd gc removes it" in text


def test_inspect_shows_parts_whole_shapes_and_placement(job):
    info = json.loads(cli("inspect", f"{RUN}/10", "--root", job["root"], "--json").output)
    assert info["world_size"] == 2 and [p["rank"] for p in info["parts"]] == [0, 1]
    assert all(p["bytes"] > 0 for p in info["parts"])
    [weight] = info["objects"]["table"]["tensors"]
    assert (weight["shape"], weight["placement"], weight["stored_by"]) == ([8, 4], "sharded",
                                                                          [0, 1])
    model = {t["path"]: t for t in info["objects"]["model"]["tensors"]}
    assert model[".module.0.weight"]["placement"] == "replicated"
    assert model[".module.0.weight"]["stored_by"] == [0]
    optim = info["objects"]["optim"]["tensors"]
    assert {t["placement"] for t in optim} == {"replicated"}
    assert {tuple(t["stored_by"]) for t in optim} == {(1,)}
    assert info["files_problem"] is None
    text = cli("inspect", f"{RUN}/10", "--root", job["root"]).output
    assert "2 ranks" in text and "sharded x2 (ranks 0-1)" in text
    assert "replicated, stored by rank 1" in text


def test_verify_checks_every_part_and_names_the_rank_and_file(job):
    ok = json.loads(cli("verify", f"{RUN}/10", "--root", job["root"], "--json").output)
    assert ok["ok"] and ok["snapshots"][0]["world_size"] == 2
    damaged = os.path.join(job["path"], "rank-00001", "optim.tensors")
    flip_byte(damaged, os.path.getsize(damaged) - 100)
    result = cli("verify", f"{RUN}/10", "--root", job["root"], "--json")
    assert result.exit_code == 1
    [bad] = json.loads(result.output)["snapshots"]
    assert bad["rank"] == 1 and bad["file"] == damaged
    assert bad["error"].startswith("rank 1: ")


def test_verify_refuses_a_part_the_record_does_not_list(job):
    manifest = os.path.join(job["path"], "rank-00000", "manifest.snapd")
    flip_byte(manifest, os.path.getsize(manifest) - 1)
    result = cli("verify", f"{RUN}/10", "--root", job["root"], "--json")
    [bad] = json.loads(result.output)["snapshots"]
    assert result.exit_code == 1 and bad["rank"] == 0 and "rank-00000" in bad["file"]


def test_export_of_a_ddp_model_loads_into_the_bare_model(job, tmp_path):
    from safetensors.torch import load_file
    out = str(tmp_path / "w.safetensors")
    result = cli("export", f"{RUN}/10", "--root", job["root"], "-o", out)
    assert result.exit_code == 0, result.output
    weights = load_file(out)
    bare = bare_model()
    bare.load_state_dict(weights)   # strict: every key without "module."
    for key, value in job["model"].state_dict().items():
        assert torch.equal(bits(weights[key]), bits(value))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_dcp_loads_back_with_dcp_load_bit_for_bit(job, tmp_path):
    from torch.distributed import checkpoint as dcp
    out = str(tmp_path / "dcp")
    result = cli("export", f"{RUN}/10", "--root", job["root"], "--format", "dcp", "-o", out)
    assert result.exit_code == 0, result.output
    saved = job["opt"].state_dict()
    state = {"model": bare_model().state_dict(),
             "optim": {"state": {i: {k: torch.zeros_like(v) for k, v in s.items()}
                                 for i, s in saved["state"].items()},
                       "param_groups": [dict(g) for g in saved["param_groups"]]},
             "table": {"weight": torch.zeros(8, 4)}}
    dcp.load(state, checkpoint_id=out, no_dist=True)
    for key, value in job["model"].state_dict().items():
        assert torch.equal(bits(state["model"][key]), bits(value))
    for i, s in saved["state"].items():
        for k, v in s.items():
            assert torch.equal(bits(state["optim"]["state"][i][k]), bits(v)), (i, k)
    assert state["optim"]["param_groups"][0]["lr"] == saved["param_groups"][0]["lr"]
    assert torch.equal(state["table"]["weight"], TABLE)
    model, opt = bare_model(), torch.optim.AdamW(bare_model().parameters())
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    again = cli("export", f"{RUN}/10", "--root", job["root"], "--format", "dcp", "-o", out)
    assert again.exit_code == 2 and "exists" in again.output


def test_diff_compares_multirank_snapshots_as_whole_tensors(job):
    model, opt = job["model"], job["opt"]
    with torch.no_grad():
        model[0].bias.add_(1)
    write_job(job["root"], 30, model, opt)
    same = cli("diff", f"{RUN}/10", f"{RUN}/10", "--root", job["root"], "--json")
    assert same.exit_code == 0 and json.loads(same.output)["equal"]
    result = cli("diff", f"{RUN}/10", f"{RUN}/30", "--root", job["root"], "--json")
    out = json.loads(result.output)
    assert result.exit_code == 1
    model_rows = out["objects"]["model"]["tensors"]
    assert model_rows[".module.0.bias"]["status"] == "different"
    assert model_rows[".module.0.weight"]["status"] == "equal"
    assert out["objects"]["table"]["tensors"][".weight"]["shape"] == [8, 4]


def test_gc_reports_the_incomplete_parts_it_removed(job):
    model, opt = job["model"], job["opt"]
    write_job(job["root"], 30, model, opt)   # LATEST now after the incomplete step 20
    result = cli("gc", "--root", job["root"], "--json")
    assert json.loads(result.output)["runs"][RUN]["incomplete_removed"] == ["00000020"]
    assert RunStore(job["root"], RUN).parts_dirs() == []


def test_an_incomplete_snapshot_is_named_as_such(job):
    result = cli("inspect", f"{RUN}/20", "--root", job["root"])
    assert result.exit_code == 2 and "holds the parts of some ranks only" in result.output
    parts = RunStore(job["root"], RUN).parts_path(SnapshotId(0, 20))
    result = cli("inspect", parts)
    assert result.exit_code == 2 and "never restored" in result.output


def log_steps(root: str, rank: int, last: int) -> None:
    """Rank ``rank``'s state log up to step ``last``, each step with its cursor."""
    store = RunStore(root, RUN)
    with LogWriter(store.path, rank, flush_interval=None) as log:
        for step in range(1, last + 1):
            log.append({"kind": "step", "step": step, "time": 1000.0 + step,
                        "cursor": [0, 2 * step], "rng": {},
                        "scalars": {"loss": 1.0 / step}, "samples": [rank, step]})


def test_status_and_watch_show_each_rank_the_global_commit_and_incomplete_parts(job):
    log_steps(job["root"], 0, 15)
    log_steps(job["root"], 1, 14)
    out = json.loads(cli("status", job["root"], "--json").output)
    [run] = out["jobs"]
    assert run["world_size"] == 2 and run["last_global_commit"] == "00000010"
    assert run["ranks"] == [{"rank": 0, "step": 15}, {"rank": 1, "step": 14}]
    assert [(w["name"], w["missing"]) for w in run["incomplete"]] == [("00000020", [0])]
    text = cli("status", job["root"]).output
    assert "job: 2 ranks, last step r0 15, r1 14; last global commit 00000010" in text
    assert "00000020 INCOMPLETE, ranks 1 present, missing 0" in text
    watched = json.loads(cli("watch", job["root"], "--json").output)
    assert watched["jobs"] == out["jobs"]
    screen = cli("watch", job["root"], "--once").output
    assert "last step r0 15, r1 14" in screen and "00000020 INCOMPLETE" in screen


def test_a_one_rank_run_has_no_job_lines(tmp_path):
    from snapd.liveview import job_lines, job_model
    store = RunStore(str(tmp_path), "solo")
    store.ensure()
    job = job_model(store, {0: 5})
    assert (job["world_size"], job["incomplete"], job_lines(job)) == (1, [], [])


def test_batch_reads_the_log_of_the_rank_asked_for(job):
    log_steps(job["root"], 0, 5)
    log_steps(job["root"], 1, 5)
    out = json.loads(cli("batch", RUN, "3", "--rank", "1", "--root", job["root"],
                         "--json").output)
    assert (out["rank"], out["samples"], out["batches"]) == (1, [1, 3], [[0, 4], [0, 5]])
    missing = cli("batch", RUN, "3", "--rank", "2", "--root", job["root"])
    assert missing.exit_code == 1 and "ranks logged: 0, 1" in missing.output
