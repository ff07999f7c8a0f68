"""A run whose loss turns NaN keeps the snapshot from before it: the anomaly is logged
and warned of once, the snapshot pinned against retention (local and remote), shown by
ls and status, and released by snapd unpin."""

from __future__ import annotations

import json
import math
import os
import warnings

from click.testing import CliRunner
from helpers import train_to_nan

from snapd import pins, statelog
from snapd.cli import main
from snapd.options import Options
from snapd.remote.retention import plan as remote_plan
from snapd.retention import apply_retention
from snapd.store import RunStore, SnapshotId
from snapd_client import Client

RUN = "r"   # the run train_to_nan trains


def cli(*args):
    result = CliRunner().invoke(main, list(args), env={"COLUMNS": "200"})
    return result.exit_code, result.output


def test_nan_at_45_pins_40_until_unpinned(tmp_path):
    root = str(tmp_path)
    said = train_to_nan(root)
    store = RunStore(root, RUN)
    # keep_last=1 would leave only 60: 40 is kept, pinned.
    assert [s.name for s in store.committed()] == ["00000040", "00000060"]
    assert pins.pinned(store.path) == [SnapshotId(0, 40)]

    # One warning, at the trainer's line (its log() call), for the whole NaN episode.
    assert len(said) == 1 and os.path.basename(said[0].filename) == "helpers.py"
    assert "step 45: loss is nan" in str(said[0].message)
    assert "snapshot 00000040 pinned" in str(said[0].message)
    anomalies = [r for r in statelog.read_records(store.path, 0)
                 if r.get("kind") == "anomaly"]
    assert len(anomalies) == 1
    assert {k: anomalies[0][k] for k in ("step", "cause", "pinned")} == \
        {"step": 45, "cause": "nonfinite:loss", "pinned": "00000040"}
    assert math.isnan(anomalies[0]["value"])
    record = pins.read_pin(store.path, SnapshotId(0, 40))
    assert record["anomaly"]["step"] == 45 and record["step"] == 40

    code, out = cli("ls", RUN, "--root", root, "--json")
    assert code == 0, out
    marks = {row["name"]: row["marks"] for row in json.loads(out)["snapshots"]}
    assert marks == {"00000040": ["PINNED"], "00000060": ["LATEST"]}
    code, out = cli("status", root)
    assert code == 0, out
    assert f"run {RUN}: pinned 00000040 before the anomaly at step 45 (nonfinite:loss)" \
        in out

    code, out = cli("watch", root, "--once")
    assert code == 0, out
    assert f"{RUN} r0: anomaly at step 45 (nonfinite:loss, value nan); pinned 00000040" \
        in out
    code, out = cli("watch", root, "--once", "--json")
    assert code == 0, out
    run_row, = [r for r in json.loads(out)["runs"] if r["run"] == RUN]
    assert run_row["retention"]["pinned"] == ["00000040"]

    # gc keeps it, and says why
    code, out = cli("gc", "--root", root, "--keep-last", "1")
    assert code == 0, out
    assert "kept 00000040: pinned" in out
    assert [s.name for s in store.committed()] == ["00000040", "00000060"]

    code, out = cli("unpin", root, f"{RUN}@40")
    assert code == 0 and "unpinned 00000040" in out, out
    assert pins.pinned(store.path) == []
    result = apply_retention(store, Options(keep_last=1))
    assert result.deleted == ["00000040"]
    assert [s.name for s in store.committed()] == ["00000060"]
    code, out = cli("unpin", root, f"{RUN}@40")
    assert code == 1 and "no pinned snapshot of run 'r' at step 40" in out


def test_remote_retention_keeps_a_pinned_commit():
    commits = [SnapshotId(0, s) for s in (20, 40, 60)]
    assert remote_plan(commits, 1, None) == commits[:2]
    assert remote_plan(commits, 1, None, pinned=[SnapshotId(0, 40)]) == commits[:1]


def test_a_pin_names_a_snapshot_still_being_written(tmp_path):
    """The snapshot handed off last counts even before its commit: a pin of it holds
    from its commit on."""
    client = Client(str(tmp_path), RUN, daemon=False)
    client._handed = SnapshotId(0, 40)   # as snapshot(40) leaves it, still in flight
    assert client._snapshot_before(45) == SnapshotId(0, 40)
    assert client._snapshot_before(40) is None   # the snapshot of the step itself is after
    client.close()


def test_an_anomaly_with_no_snapshot_before_it_pins_nothing(tmp_path):
    client = Client(str(tmp_path), RUN, daemon=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        client.log(1, loss=math.inf)
    client.close()
    assert "no snapshot before it to pin" in str(caught[-1].message)
    assert not os.path.exists(pins.pins_path(os.path.join(str(tmp_path), RUN)))
