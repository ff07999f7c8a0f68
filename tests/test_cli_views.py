"""What `snapd status`, `snapd watch`'s model and the listing commands show: status
from the committed directories (not the log's view), output that a pipe gets whole,
and the small wording fixes (plurals, epoch numbering, the @best error)."""

from __future__ import annotations

import json
import os

import torch
from click.testing import CliRunner

from snapd import liveview
from snapd.cli import main
from snapd.logwriter import LogWriter
from snapd.progress import read_progress
from snapd.store import RunStore, SnapshotId
from snapd.humanize import count
from snapd_client import Client

LONG_RUN = "a-run-name-long-enough-that-eighty-columns-would-cut-it-" + "x" * 30


def killed_after_commit(root: str, latest: str | None, dirs=("00000010", "00000020"),
                        resume_refused=None) -> RunStore:
    """A run killed right after snapshot 20 committed: steps 1..20 logged, the log's
    last commit record is step 10's (the client died before logging 20's), and the
    snapshot directories are there; LATEST as given (None: not moved yet)."""
    store = RunStore(root, "r")
    store.ensure()
    with LogWriter(store.path, 0, flush_interval=None) as log:
        if resume_refused is not None:
            log.append({"kind": "resume", "step": 0, "snapshot": None,
                        "refused": resume_refused})
        for step in range(1, 21):
            log.append({"kind": "step", "step": step, "time": 1000.0 + step, "cursor": None,
                        "rng": {}, "scalars": {"loss": 1.0}})
            if step == 10:
                log.append({"kind": "snapshot", "event": "committed", "step": 10,
                            "time": 1010.0, "name": "00000010", "bytes": 1, "seconds": 0.1})
    for name in dirs:
        os.mkdir(os.path.join(store.snapshots_path, name))
    if latest:
        store.write_pointer("LATEST", SnapshotId.parse(latest))
    return store


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_the_committed_directory_wins_over_the_log(tmp_path):
    store = killed_after_commit(str(tmp_path), latest="00000010")  # LATEST not moved yet
    progress = read_progress(store)
    assert progress.committed == SnapshotId(0, 20) and progress.at_risk == 0
    assert progress.committed_time == os.stat(
        os.path.join(store.snapshots_path, "00000020")).st_mtime

    (row,) = json.loads(invoke("status", str(tmp_path), "--json").output)["runs"]
    assert row["committed"] == "00000020" and row["at_risk"] == 0
    table = invoke("status", str(tmp_path)).output
    assert "00000020" in table and "00000010" not in table


def test_watch_model_agrees_with_the_directories(tmp_path):
    store = killed_after_commit(str(tmp_path), latest="00000020")
    row = liveview.rank_model(store, 0, now=2000.0)
    assert row["at_risk"] == 0
    assert row["last_committed"]["name"] == "00000020"


def test_a_snapshot_the_last_resume_refused_is_not_the_committed_one(tmp_path):
    store = killed_after_commit(str(tmp_path), latest="00000030",
                                dirs=("00000010", "00000020", "00000030"),
                                resume_refused={"00000030": "damaged"})
    progress = read_progress(store)
    assert progress.committed == SnapshotId(0, 20) and progress.at_risk == 0


def test_piped_status_and_ls_are_never_cut(tmp_path):
    root = str(tmp_path)
    torch.manual_seed(0)
    client = Client(root, LONG_RUN, daemon=False)
    client.track(model=torch.nn.Linear(2, 2))
    client.log(1)
    client.snapshot(1).wait()
    client.close()
    for args in (("status", root), ("ls", "--root", root)):
        output = invoke(*args).output   # CliRunner's stdout is no terminal
        assert LONG_RUN in output, output
        assert "…" not in output
    assert "LATEST" in invoke("ls", "--root", root).output


def test_counts_agree_with_their_nouns():
    assert count(1, "update") == "1 update"
    assert count(2, "update") == "2 updates" and count(0, "step") == "0 steps"
    assert count(1, "batch", "batches") == "1 batch"
    assert count(3, "batch", "batches") == "3 batches"


def test_batch_says_epochs_count_from_0(tmp_path):
    root = str(tmp_path)
    store = RunStore(root, "r")
    store.ensure()
    with LogWriter(store.path, 0, flush_interval=None) as log:
        for step, cursor in ((1, [0, 1]), (2, [0, 2])):
            log.append({"kind": "step", "step": step, "time": 1.0, "cursor": cursor,
                        "rng": {}, "scalars": {}})
    text = invoke("batch", "r", "2", "--root", root).output
    assert "epochs and batches count from 0" in text and "epoch 0 batch 1" in text
    assert json.loads(invoke("batch", "r", "2", "--root", root, "--json").output
                      )["counted_from"] == 0


def test_missing_best_error_is_sentences(tmp_path):
    root = str(tmp_path)
    RunStore(root, "r").ensure()
    result = invoke("inspect", "r@best", "--root", root)
    assert result.exit_code == 2
    assert "when snapshots carry a metric. Use RUN/NAME" in result.output
