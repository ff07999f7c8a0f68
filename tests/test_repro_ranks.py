"""snapd repro on many ranks, the client's side (snapd_client/repro.py): the world
size is the run's, and the ranks' verdicts are exchanged at each step so that a
divergence on one rank stops every rank, naming it, before anything is written.
Each rank runs on a thread of its own, met by a collective of threads; the real
torchrun job is in tests/integration/test_multirank.py."""

from __future__ import annotations

import json
import os
import threading

import pytest
from helpers import ThreadCollective, logged_step

from snapd.errors import InvalidOption, ReplayDivergence
from snapd.logwriter import LogWriter
from snapd.store import RunStore
from snapd_client.repro import requested

STEP = 19


@pytest.fixture
def two_rank_run(tmp_path):
    """Run "r" whose ranks 0 and 1 logged steps 1 to STEP; (root, SNAPD_REPRO's map)."""
    root = str(tmp_path / "root")
    store = RunStore(root, "r")
    store.ensure()
    for rank in (0, 1):
        with LogWriter(store.path, rank, flush_interval=None,
                       fsync=lambda fd: None) as writer:
            writer.append_many(logged_step(s) for s in range(1, STEP + 1))
    asked = {"root": root, "run": "r", "step": STEP, "out": f"r.repro-{STEP}",
             "report": str(tmp_path / "outcome.json")}
    return root, {"SNAPD_REPRO": json.dumps(asked)}


def test_a_one_rank_command_of_a_two_rank_run_is_refused(two_rank_run):
    root, env = two_rank_run
    with pytest.raises(InvalidOption, match=r"logged step 19 on 2 rank\(s\) \(0, 1\).*"
                       "torchrun --nproc-per-node 2") as e:
        requested(root, "r", env).on_ranks(0, 1)
    assert e.value.field == "world_size"


def test_a_divergence_on_one_rank_stops_every_rank_naming_it_before_any_write(
        two_rank_run, tmp_path):
    """Both ranks restored step 16 and recompute 17: rank 1's loss differs from its
    log. Rank 0 matched, yet it raises too, with rank 1's step and field; each
    rank's outcome file says so, and the reproduction's run does not exist."""
    root, env = two_rank_run
    threads, raised = ThreadCollective(2), [None, None]
    recomputed = [logged_step(17), {**logged_step(17), "scalars": {"loss": 0.5}}]

    def rank_(rank):
        repro = requested(root, "r", env)
        repro.on_ranks(rank, 2, threads.member(rank))
        repro.begin(None, "00000016", 16)   # nothing written at 16: STEP is 19
        try:
            repro.log(None, recomputed[rank])
        except ReplayDivergence as e:
            raised[rank] = e

    workers = [threading.Thread(target=rank_, args=(r,)) for r in (0, 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    assert all(isinstance(e, ReplayDivergence) for e in raised), raised
    assert [(e.step, e.cause) for e in raised] == [(17, "scalar:loss")] * 2
    assert str(raised[0]) == str(raised[1])
    assert str(raised[0]).startswith("repro of run r, rank 1: step 17 differs from the "
                                     "run's log (rank 1's): loss was")
    assert "nothing was written" in str(raised[0])
    for rank in (0, 1):
        with open(tmp_path / f"outcome.json.rank-{rank}") as f:
            outcome = json.load(f)
        assert (outcome["ok"], outcome["step"], outcome["error"]) == \
            (False, 17, str(raised[0]))
    assert not os.path.exists(os.path.join(root, f"r.repro-{STEP}"))
