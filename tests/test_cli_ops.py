"""The operator's commands (ls, inspect, verify, diff, gc, export, plot) on real snapshots.

One run is trained once per module (a small model and AdamW, snapshots at steps 1 and
2, ``Client.log`` every step); tests that damage or delete copy it first.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

from snapd import format as fmt
from snapd.reader import SnapshotReader
from snapd.cli import main
from snapd_client import Client

from helpers import flip_byte, private_copy, trained_root

RUN = "gpt"


def train(root: str, run: str = RUN, steps=(1, 2, 3), snapshot_at=(1, 2)) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    client = Client(root, run, data_version="v1", daemon=False)
    client.track(model=model, optimizer=opt)
    x, y = torch.randn(32, 8), torch.randn(32, 3)
    for step in steps:
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        client.log(step, loss=loss.item())
        if step in snapshot_at:
            client.snapshot(step, metric=loss.item()).wait()
    client.close()
    return model


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return trained_root(tmp_path_factory, "ops", train)


@pytest.fixture
def root(pristine, tmp_path):
    """A private copy of the trained root, free to damage."""
    return private_copy(pristine, tmp_path)


def cli(*args: str):
    result = CliRunner().invoke(main, list(args), env={"COLUMNS": "200"},
                                catch_exceptions=False)
    return result


def snap(root: str, name: str) -> str:
    return os.path.join(root, RUN, "snapshots", name)


# --- ls ---------------------------------------------------------------------------

def test_ls_lists_both_with_latest_mark(pristine):
    result = cli("ls", "--root", pristine)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if "0000000" in line]
    assert len(lines) == 2
    assert "LATEST" in lines[1] and "LATEST" not in lines[0]
    assert "manifest ok" in lines[0]

    data = json.loads(cli("ls", RUN, "--root", pristine, "--json").output)
    rows = data["snapshots"]
    assert [r["name"] for r in rows] == ["00000001", "00000002"]
    assert [r["step"] for r in rows] == [1, 2]
    # the loss falls, so the latest is also the best (in-process writes move BEST too)
    assert rows[1]["marks"] == ["LATEST", "BEST"] and rows[0]["marks"] == []
    assert all(r["verified"] == "manifest ok" and r["bytes"] > 0 for r in rows)
    assert rows[0]["metric"] is not None and rows[0]["lineage"]["id"] == 0

    verified = json.loads(cli("ls", "--root", pristine, "--verify", "--json").output)
    assert all(r["verified"] == "ok" for r in verified["snapshots"])


# --- inspect ------------------------------------------------------------------------

def test_inspect_shows_tensors_from_the_manifest(pristine):
    result = cli("inspect", f"{RUN}/1", "--root", pristine)
    assert result.exit_code == 0, result.output
    for text in (".0.weight", "float32", "(16, 8)", "torch.optim.adamw.AdamW", "exp_avg_sq",
                 "rng streams", "torch"):
        assert text in result.output

    info = json.loads(cli("inspect", RUN, "--root", pristine, "--json").output)
    assert info["step"] == 2 and info["data_version"] == "v1"
    model = info["objects"]["model"]
    assert model["count"] == 4
    assert {t["path"]: t["shape"] for t in model["tensors"]}[".0.weight"] == [16, 8]
    assert model["tensors"][0]["codecs"] == ["raw"] and model["tensors"][0]["bytes"] == 512
    assert info["objects"]["optimizer"]["count"] == 12
    assert set(info["rng"]) >= {"python", "numpy", "torch"}
    assert info["lineage"]["mode"] == "fresh" and info["cursor"] is None


def test_snapshot_argument_forms_resolve_to_the_same_directory(pristine):
    path = snap(pristine, "00000002")
    for spec in (path, f"{RUN}/00000002", f"{RUN}/2", RUN, f"{RUN}@latest",
                 os.path.join(pristine, RUN)):
        info = json.loads(cli("inspect", spec, "--root", pristine, "--json").output)
        assert info["path"] == path, spec


# --- verify -------------------------------------------------------------------------

def test_verify_passes_on_good_snapshots(pristine):
    result = cli("verify", f"{RUN}/1", "--root", pristine)
    assert result.exit_code == 0, result.output
    assert "ok" in result.output
    data = json.loads(cli("verify", "--all", "--root", pristine, "--json").output)
    assert data["ok"] and [r["snapshot"] for r in data["snapshots"]] == [
        f"{RUN}/00000001", f"{RUN}/00000002"]


@pytest.mark.parametrize("name", ["manifest.snapd", "model.tensors", "optimizer.tensors"])
def test_verify_catches_a_flipped_byte_in_each_file_kind(root, name):
    path = os.path.join(snap(root, "00000001"), name)
    end = os.path.getsize(path)  # the manifest's payload ends the file
    if name != fmt.MANIFEST_NAME:  # a tensor file ends in padding: aim at the last chunk
        objects = SnapshotReader(snap(root, "00000001")).objects
        offset, stored = objects[name.split(".")[0]]["tensors"][-1]["chunks"][-1][:2]
        end = offset + stored
    flip_byte(path, end - 3)
    result = cli("verify", f"{RUN}/1", "--root", root)
    assert result.exit_code == 1, result.output
    assert "DAMAGED" in result.output and name in result.output
    if name != fmt.MANIFEST_NAME:
        assert "chunk" in result.output
    # --all reports the damaged one and still checks the good one.
    data = json.loads(cli("verify", "--all", "--root", root, "--json").output)
    assert not data["ok"]
    verdicts = {r["snapshot"]: r for r in data["snapshots"]}
    assert verdicts[f"{RUN}/00000002"]["ok"]
    assert verdicts[f"{RUN}/00000001"]["file"].endswith(name)
    # ls --verify marks it too, and exits 1.
    assert cli("ls", "--root", root, "--verify").exit_code == 1


# --- diff ---------------------------------------------------------------------------

def test_diff_itself_equal_and_next_different(pristine):
    same = cli("diff", f"{RUN}/1", f"{RUN}/1", "--root", pristine)
    assert same.exit_code == 0, same.output
    assert "EQUAL" in same.output

    other = cli("diff", f"{RUN}/1", f"{RUN}/2", "--root", pristine, "--json")
    assert other.exit_code == 1
    data = json.loads(other.output)
    assert not data["equal"]
    row = data["objects"]["model"]["tensors"][".0.weight"]
    assert row["status"] == "different" and row["max_abs"] > 0 and row["max_rel"] > 0
    assert data["objects"]["optimizer"]["tensors"][".state.0.step"]["max_abs"] == 1.0


def test_diff_compares_bfloat16_in_float64_and_ints_exactly():
    from snapd.commands.diff import compare_tensor

    a = torch.tensor([1.0, 2.0, -0.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0, 2.015625, 0.0], dtype=torch.bfloat16)
    row = compare_tensor(a, b)
    assert row["status"] == "different" and row["max_abs"] == 0.015625
    assert row["elements_different"] == 1  # -0.0 vs 0.0: equal values, other bits
    ints = compare_tensor(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4]))
    assert ints["status"] == "different" and ints["max_abs"] == 1.0
    assert compare_tensor(torch.ones(2, 2), torch.ones(4))["status"] == "mismatch"
    assert compare_tensor(torch.tensor([True]), torch.tensor([True]))["status"] == "equal"


# --- export -------------------------------------------------------------------------

def test_export_matches_model_weights_bit_for_bit(pristine, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = str(tmp_path / "model.safetensors")
    result = cli("export", f"{RUN}/2", "--root", pristine, "--format", "safetensors", "-o", out)
    assert result.exit_code == 0, result.output
    loaded = load_file(out)
    model = train(str(tmp_path / "again"), steps=(1, 2), snapshot_at=())
    expected = model.state_dict()
    assert set(loaded) == set(expected)
    assert not any("exp_avg" in k or "state" in k for k in loaded)
    for key, tensor in expected.items():
        assert torch.equal(loaded[key], tensor), key
    with safe_open(out, "pt") as f:
        meta = f.metadata()
    assert meta["snapd.run"] == RUN and meta["snapd.step"] == "2"
    assert meta["snapd.snapshot"] == "00000002" and meta["snapd.data_version"] == "v1"
    assert meta["snapd.base_revision"] == ""
    assert not any(pristine in v for v in meta.values())


def test_export_refuses_the_optimizer(pristine, tmp_path):
    result = cli("export", RUN, "--root", pristine, "-o", str(tmp_path / "o.safetensors"),
                 "--object", "optimizer")
    assert result.exit_code == 2
    assert "not a torch.nn.Module" in result.output
    assert not os.path.exists(tmp_path / "o.safetensors")


# --- gc -----------------------------------------------------------------------------

def test_gc_dry_run_deletes_nothing(root):
    before = sorted(os.listdir(os.path.join(root, RUN, "snapshots")))
    result = cli("gc", "--root", root, "--keep-last", "1", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "would delete 00000001" in result.output
    assert sorted(os.listdir(os.path.join(root, RUN, "snapshots"))) == before
    data = json.loads(cli("gc", "--root", root, "--keep-last", "1", "--dry-run",
                          "--json").output)
    assert data["runs"][RUN]["deleted"] == ["00000001"]
    assert sorted(os.listdir(os.path.join(root, RUN, "snapshots"))) == before


def test_gc_keep_last_deletes_the_older_never_the_latest(root):
    result = cli("gc", "--root", root, "--run", RUN, "--keep-last", "1", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["runs"][RUN]["deleted"] == ["00000001"]
    assert os.listdir(os.path.join(root, RUN, "snapshots")) == ["00000002"]
    # Again: the last one stays, whatever the rule.
    again = json.loads(cli("gc", "--root", root, "--keep-last", "1", "--json").output)
    assert again["runs"][RUN]["deleted"] == []
    assert os.listdir(os.path.join(root, RUN, "snapshots")) == ["00000002"]


def test_gc_never_deletes_what_latest_names(root):
    with open(os.path.join(root, RUN, "LATEST"), "w") as f:
        f.write("00000001\n")  # as after a crash between commit and pointer update
    data = json.loads(cli("gc", "--root", root, "--keep-last", "1", "--json").output)
    assert data["runs"][RUN]["deleted"] == []
    assert data["runs"][RUN]["protected_latest"] == ["00000001"]


# --- plot ---------------------------------------------------------------------------

def test_plot_writes_a_png(pristine, tmp_path):
    out = tmp_path / "loss.png"
    result = cli("plot", RUN, "--root", pristine, "-o", str(out), "--json")
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(result.output)
    assert [s for s, _ in data["lines"]["0"]] == [1, 2, 3]
    assert [s["step"] for s in data["snapshots"]] == [1, 2]
    missing = cli("plot", RUN, "--root", pristine, "-o", str(out), "--scalar", "acc")
    assert missing.exit_code == 1 and "loss" in missing.output


def test_plot_keeps_the_newest_record_of_a_replayed_step(root, tmp_path):
    from snapd.commands.plot import series
    from snapd.logwriter import LogWriter

    writer = LogWriter(os.path.join(root, RUN), 0)
    writer.append({"kind": "resume", "step": 2, "time": 0.0, "snapshot": "00000002",
                   "mode": "resume", "lineage": {"id": 0}})
    writer.append({"kind": "step", "step": 3, "time": 0.0, "cursor": None, "rng": {},
                   "scalars": {"loss": -1.0}})
    writer.close()
    data = series(os.path.join(root, RUN), 0, "loss")
    assert dict(data["lines"][0])[3] == -1.0 and len(data["lines"][0]) == 3
    assert data["resumes"][0]["step"] == 2


# --- errors -------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["inspect", "verify", "export"])
def test_missing_snapshot_exits_2_naming_the_path(pristine, command, tmp_path):
    extra = ["-o", str(tmp_path / "x.safetensors")] if command == "export" else []
    result = cli(command, f"{RUN}/00000099", "--root", pristine, *extra)
    assert result.exit_code == 2
    assert snap(pristine, "00000099") in result.output
    gone = cli(command, str(tmp_path / "nowhere"), "--root", pristine, *extra)
    assert gone.exit_code == 2 and str(tmp_path / "nowhere") in gone.output


def test_missing_run_and_pointer_exit_2(root):
    result = cli("diff", "nope/1", f"{RUN}/1", "--root", root)
    assert result.exit_code == 2 and os.path.join(root, "nope") in result.output
    assert cli("inspect", f"{RUN}@best", "--root", root).exit_code == 0
    os.unlink(os.path.join(root, RUN, "BEST"))
    best = cli("inspect", f"{RUN}@best", "--root", root)
    assert best.exit_code == 2 and os.path.join(root, RUN, "BEST") in best.output
    assert cli("verify", "--root", root).exit_code == 2  # neither SNAPSHOT nor --all


def test_every_command_has_an_example():
    for name in ("ls", "inspect", "verify", "diff", "gc", "export", "plot"):
        result = cli(name, "--help")
        assert result.exit_code == 0 and "Example: snapd " + name in result.output


def test_a_filesystem_error_is_one_line_and_exit_1_never_a_traceback(tmp_path):
    """A run whose snapshots/ is a file: every command that reaches it says so."""
    (tmp_path / RUN).mkdir()
    (tmp_path / RUN / "snapshots").write_bytes(b"not a directory")
    result = CliRunner().invoke(main, ["inspect", f"{RUN}/00000001", "--root",
                                       str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "Not a directory" in result.output and "snapshots" in result.output
    assert not isinstance(result.exception, OSError)  # handled, not escaped
