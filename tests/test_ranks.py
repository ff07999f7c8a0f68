"""A rank's identity and session, and the writer of each replicated tensor: pure
functions, no process group."""

from __future__ import annotations

import pytest
import torch

from snapd.errors import InvalidOption
from snapd_client.ranks import RankInfo, default_session, detect
from snapd_client.replicas import assign, mesh_owner


def test_detect_takes_what_is_given_then_the_environment():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    assert detect(environ=env) == RankInfo(3, 4, 1)
    assert detect(0, 2, environ=env) == RankInfo(0, 2, 1)
    assert detect(environ={}) == RankInfo(0, 1, 0)
    assert detect(environ=env).many and not detect(environ={}).many
    # A job of one keeps any rank as a label, as before many ranks existed.
    assert detect(1, environ={}) == RankInfo(1, 1, 0)


@pytest.mark.parametrize("rank, world, env", [
    (2, 2, {}), (-1, 2, {}), (-1, 1, {}), (0, 0, {}), (None, None, {"RANK": "x"}),
    (None, None, {"RANK": "4", "WORLD_SIZE": "4"}),
])
def test_detect_refuses_a_rank_outside_the_job(rank, world, env):
    with pytest.raises(InvalidOption) as info:
        detect(rank, world, environ=env)
    assert info.value.field in ("rank", "RANK")


def test_the_default_session_is_torchruns_attempt_else_snapd_session_else_none():
    torchrun = {"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2",
                "SNAPD_SESSION": "mine"}
    assert default_session(torchrun) == "abc:2"
    assert default_session({"SNAPD_SESSION": "mine"}) == "mine"
    assert default_session({}) == "none"


def test_assign_balances_by_bytes_deterministically():
    items = [(100, "model", ".a"), (60, "model", ".b"), (50, "opt", ".c"),
             (50, "model", ".d"), (0, "model", ".e")]
    owners = assign(items, 2)
    assert owners == {("model", ".a"): 0, ("model", ".b"): 1, ("model", ".d"): 1,
                      ("opt", ".c"): 0, ("model", ".e"): 1}
    assert assign(list(reversed(items)), 2) == owners   # order of discovery is irrelevant
    assert set(assign(items, 1).values()) == {0}


def test_a_mesh_piece_is_written_at_coordinate_zero_of_each_replicated_dim():
    ranks = torch.arange(6).reshape(2, 3)   # dim 0 replicated, dim 1 sharded (HSDP)
    assert mesh_owner(ranks, (1, 2), [0]) == 2
    assert mesh_owner(ranks, (0, 1), [0]) == 1
    assert mesh_owner(ranks, (1, 2), []) == 5
    assert mesh_owner(ranks, (1, 2), [0, 1]) == 0
