"""restore(overlap=True) on many ranks from the remote tier, the parts that need no
process (snapd_client/remoteranks.py): a commit of two ranks pulled but for its
optimizers' files, the pull of each root shared by its ranks, the download of those
files learnt by every rank in one all-gather, the commit only after the ranks' join,
and what damage or a failed download leaves; also at another world size (a
reshard). The ranks are threads meeting in a fake collective (ThreadCollective); the
remote is a file:// one filled by the uploader's own upload_snapshot."""

import os
import threading
import warnings
from types import SimpleNamespace

import pytest
import torch

from helpers import ThreadCollective, assert_equal, flip_byte, read_manifest
from snapd.errors import CorruptSnapshot, RemoteUnavailable
from snapd.options import Options
from snapd.plan import ObjectPlan, SnapshotPlan, TensorSource
from snapd.remote.layout import RemoteRoot
from snapd.remote.pendingpull import begin_pull, set_aside_remotely
from snapd.remote.pull import pull
from snapd.remote.upload import upload_snapshot
from snapd.store import RunStore, SnapshotId
from snapd.writer import write_snapshot
from snapd_client.capture import tensor_bytes
from snapd_client.distrestore import Parts, deferred_read, prepare
from snapd_client.fromremote import RemoteWarning, pull_for_ranks
from snapd_client.remotearrival import later_objects
from snapd_client.remoteranks import PulledJoin, PulledRead, shared_pull
from snapd_client.restore import type_name
from snapd_client.rng import RngStreams
from snapd_client.state import flatten

RUN, NEWEST, OLDER = "r", SnapshotId(0, 5), SnapshotId(0, 3)


def _model_and_opt(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return model, opt


def _write(store, step, rank, model, opt):
    """Rank ``rank``'s part: its own weights; Adam's first moments stored by rank 0
    and its second by rank 1, each referred to by the other (a replicated tensor is
    read where it is stored)."""
    other = ".state.{}.exp_avg_sq" if rank == 0 else ".state.{}.exp_avg"
    refs = {other.format(i): {"ref": 1 - rank} for i in (0, 1)}
    objects = []
    for name, obj, placed in (("model", model, {}), ("optimizer", opt, refs)):
        flat = flatten(obj.state_dict(), name)
        objects.append(ObjectPlan(name, type_name(obj), flat.skeleton, [
            TensorSource(p, str(t.dtype).split(".")[1], list(t.shape), tensor_bytes(t),
                         **placed.get(p, {})) for p, t in zip(flat.paths, flat.tensors)]))
    write_snapshot(store, SnapshotPlan(
        run=RUN, step=step, lineage={"id": 0, "mode": "fresh", "parent": None},
        objects=objects, rng=RngStreams().capture(), rank=rank, world_size=2,
        session=f"s{step}"), Options())


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """A file:// remote holding 2-rank snapshots 3 and 5 of RUN; its URL, and the
    tracked objects both ranks restore into."""
    base = tmp_path_factory.mktemp("remote-ranks")
    store = RunStore(str(base / "trained"), RUN)
    store.ensure()
    model, opt = _model_and_opt(1)
    for step in (3, 5):
        for rank in range(2):
            _write(store, step, rank, model, opt)
    url = f"file://{base / 'remote'}"
    for sid in store.committed():
        upload_snapshot(RemoteRoot(url), store, sid.name)
    return url, store


def stand_in(root, url, rank):
    return SimpleNamespace(options=Options(remote=url, remote_timeout=30.0), run=RUN,
                           rank=rank, store=RunStore(root, RUN), _keys=None)


def on_ranks(coll, work):
    """``work(rank, member)`` on one thread per rank; each rank's result or error."""
    out = [None] * coll.world

    def one(rank):
        try:
            out[rank] = work(rank, coll.member(rank))
        except Exception as e:   # the test looks at it
            out[rank] = e

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RemoteWarning)
        threads = [threading.Thread(target=one, args=(r,)) for r in range(coll.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads)
    return out


def tracked():
    model, opt = _model_and_opt(2)   # other values: the restore must replace them
    return {"model": model, "optimizer": opt}


def read_later(path, rank, objects, check_files=True, world=2):
    """What restore with overlap reads of ``path`` on ``rank`` of ``world``: (prepared,
    the background read of the deferred optimizers)."""
    parts = Parts(path, check_files=check_files)
    got = prepare(parts, rank, world, objects, RngStreams(), data_version=None,
                  stream=None, omit=set(), defer={"optimizer"})
    return got, deferred_read(parts, rank, objects, got.deferred)


def pulled_on_ranks(coll, roots, url):
    """Each rank's RootPull: the pull (in two halves) of the lowest rank on each root."""
    later = later_objects(["optimizer"], set())
    return on_ranks(coll, lambda rank, member: shared_pull(
        member, pull_for_ranks(member, stand_in(roots[rank], url, rank), later)))


def read_and_join(coll, pulls, roots):
    """Each rank's background read, then the join: (its states or error, what the
    join told it)."""
    def work(rank, member):
        pull = pulls[rank]
        _, read = read_later(pull.tmp, rank, tracked(), check_files=False,
                             world=coll.world)
        try:
            states, mine = PulledRead(pull, member, read, names=["optimizer"],
                                      threads=2, timeout=30.0)(), None
        except Exception as e:
            states, mine = None, e
        final = RunStore(roots[rank], RUN).snapshot_path(SnapshotId.parse(pull.name))
        join = PulledJoin(member, pull, SimpleNamespace(path=pull.where), final)
        return states or mine, join.exchange(mine, pull.where)
    return on_ranks(coll, work)


def test_a_commit_of_two_ranks_is_pulled_but_for_its_optimizers_files(remote, tmp_path):
    url, trained = remote
    store = RunStore(str(tmp_path / "node"), RUN)
    later = later_objects(["optimizer"], set())
    # One rank's restore pulls it whole; a restore on many ranks reads it by parts.
    assert begin_pull(RemoteRoot(url), store, NEWEST.name, later) is None
    pending = begin_pull(RemoteRoot(url), store, NEWEST.name, later, parts=True)
    assert pending.later == ["optimizer"] and store.committed() == []
    for rank in range(2):
        part = os.path.join(pending.tmp, f"rank-0000{rank}")
        assert not os.path.exists(os.path.join(part, read_manifest(part)["objects"]
                                               ["optimizer"]["file"]))
        assert os.path.exists(os.path.join(part, read_manifest(part)["objects"]
                                           ["model"]["file"]))
    whole = trained.snapshot_path(NEWEST)
    for rank in range(2):
        got, _ = read_later(pending.tmp, rank, tracked(), check_files=False)
        want, read = read_later(whole, rank, tracked())
        assert got.deferred == ("optimizer",)
        assert_equal(got.states, want.states, f"rank {rank}: what restore applies now")
    pending.fetch()
    pending.verify_later()
    pending.commit()
    assert store.committed() == [NEWEST] and store.read_pointer("LATEST") == NEWEST


def test_two_ranks_on_one_root_read_the_moments_once_downloaded_and_commit_after(
        remote, tmp_path):
    url, trained = remote
    roots = [str(tmp_path / "node")] * 2
    coll = ThreadCollective(2)
    pulls = pulled_on_ranks(coll, roots, url)
    assert pulls[0].pending is not None and pulls[1].pending is None   # rank 0 pulls
    assert pulls[0].tmp == pulls[1].tmp and pulls[1].puller == 0
    store = RunStore(roots[0], RUN)
    assert store.committed() == []   # pending: nothing committed before the join
    out = read_and_join(coll, pulls, roots)
    for rank, (states, others) in enumerate(out):
        assert others == []
        _, read = read_later(trained.snapshot_path(NEWEST), rank, tracked())
        assert_equal(states, read(), f"rank {rank}'s moments")
    assert store.committed() == [NEWEST] and not os.path.exists(pulls[0].tmp)


def test_node_local_roots_each_pull_and_commit_their_own(remote, tmp_path):
    url, _ = remote
    roots = [str(tmp_path / "node-a"), str(tmp_path / "node-b")]
    coll = ThreadCollective(2)
    pulls = pulled_on_ranks(coll, roots, url)
    assert [p.puller for p in pulls] == [0, 1] and all(p.pending for p in pulls)
    assert [others for _, others in read_and_join(coll, pulls, roots)] == [[], []]
    assert [RunStore(r, RUN).committed() for r in roots] == [[NEWEST], [NEWEST]]


def test_damage_in_a_remote_optimizer_file_fails_every_rank_and_is_passed_over_next(
        remote, tmp_path):
    url, trained = remote
    # A copy of the remote, with rank 1's optimizer file damaged.
    base = tmp_path / "damaged-remote"
    damaged_url = f"file://{base}"
    for sid in trained.committed():
        upload_snapshot(RemoteRoot(damaged_url), trained, sid.name)
    remote_dir = RemoteRoot(damaged_url).snapshot_path(RUN, NEWEST.name)
    part = os.path.join(trained.snapshot_path(NEWEST), "rank-00001")
    entry = read_manifest(part)["objects"]["optimizer"]
    bad = os.path.join(remote_dir, "rank-00001", entry["file"])
    flip_byte(bad, entry["tensors"][0]["chunks"][0][0] + 3)
    roots = [str(tmp_path / "node-a"), str(tmp_path / "node-b")]
    coll = ThreadCollective(2)
    pulls = pulled_on_ranks(coll, roots, damaged_url)
    out = read_and_join(coll, pulls, roots)
    for rank, (error, _) in enumerate(out):
        assert isinstance(error, CorruptSnapshot), error
        assert error.path.endswith(f"{NEWEST.name}/rank-00001/{entry['file']}")
        assert pulls[rank].tmp not in str(error)   # named by the remote file
    for root in roots:   # kept aside on every root, committed on none
        store = RunStore(root, RUN)
        assert store.committed() == [] and set_aside_remotely(store) == {NEWEST.name}
    # The next start of every rank passes it over: the older commit is pulled.
    again = pulled_on_ranks(coll, roots, damaged_url)
    assert [p.name for p in again] == [OLDER.name] * 2
    for p in again:
        p.abandon()


def test_a_failed_download_fails_every_rank_of_the_root_and_leaves_nothing(
        remote, tmp_path):
    url, trained = remote
    base = tmp_path / "vanishing-remote"
    gone_url = f"file://{base}"
    upload_snapshot(RemoteRoot(gone_url), trained, NEWEST.name)
    roots = [str(tmp_path / "node")] * 2
    coll = ThreadCollective(2)
    pulls = pulled_on_ranks(coll, roots, gone_url)
    remote_dir = RemoteRoot(gone_url).snapshot_path(RUN, NEWEST.name)
    entry = read_manifest(os.path.join(pulls[0].tmp, "rank-00000"))["objects"]["optimizer"]
    os.unlink(os.path.join(remote_dir, "rank-00000", entry["file"]))   # after the listing
    out = read_and_join(coll, pulls, roots)
    assert not isinstance(out[0][0], CorruptSnapshot) and isinstance(out[0][0], Exception)
    assert isinstance(out[1][0], RemoteUnavailable)
    assert "rank 0, which pulls for this root, could not download" in str(out[1][0])
    assert [o["rank"] for o in out[1][1]] == [0]   # rank 1 hears of rank 0's failure
    store = RunStore(roots[0], RUN)
    assert store.committed() == [] and set_aside_remotely(store) == set()
    assert not os.path.exists(pulls[0].tmp)   # the next start pulls again


def test_roots_that_do_not_all_have_it_pending_finish_their_pulls_whole(remote, tmp_path):
    url, _ = remote
    roots = [str(tmp_path / "node-a"), str(tmp_path / "node-b")]
    pull(RemoteRoot(url), RunStore(roots[1], RUN), NEWEST.name)   # node-b has it
    pulls = pulled_on_ranks(ThreadCollective(2), roots, url)
    assert pulls == [None, None]   # no shared pending pull: the agreement as without
    assert [RunStore(r, RUN).committed() for r in roots] == [[NEWEST], [NEWEST]]


def test_a_pending_commit_the_agreement_refuses_is_set_aside_one_passed_over_committed(
        remote, tmp_path):
    url, _ = remote
    refused_root, older_root = str(tmp_path / "node-a"), str(tmp_path / "node-b")
    pulls = pulled_on_ranks(ThreadCollective(2), [refused_root] * 2, url)
    with pytest.warns(RemoteWarning, match=f"{NEWEST.name} is not committed locally"):
        for p in pulls:   # refused as damaged on some rank: every rank has left it
            p.after_agreement(None, {NEWEST.name: "rank 1: damaged"})
    assert set_aside_remotely(RunStore(refused_root, RUN)) == {NEWEST.name}
    pulls = pulled_on_ranks(ThreadCollective(2), [older_root] * 2, url)
    for p in pulls:   # verify_steps chose an older one: this one finished whole
        p.after_agreement(OLDER.name, {})
    assert RunStore(older_root, RUN).committed() == [NEWEST]


def test_a_pull_left_pending_commits_nothing_and_the_next_start_pulls_again(
        remote, tmp_path):
    url, _ = remote
    roots = [str(tmp_path / "node")] * 2
    # The state a kill before the join leaves: the download, never read again.
    left = pulled_on_ranks(ThreadCollective(2), roots, url)
    store = RunStore(roots[0], RUN)
    assert store.committed() == [] and os.path.isdir(left[0].tmp)
    coll = ThreadCollective(2)
    again = pulled_on_ranks(coll, roots, url)
    assert again[0].tmp != left[0].tmp   # a download of its own; the old one unread
    assert [others for _, others in read_and_join(coll, again, roots)] == [[], []]
    assert store.committed() == [NEWEST]


class _GoneCollective:
    """A collective whose peers are gone: every exchange fails."""

    rank, world_size = 0, 2

    def allgather_bytes(self, data):
        raise RuntimeError("Connection closed by peer")


def test_a_join_that_cannot_hear_every_rank_removes_the_download(remote, tmp_path):
    url, _ = remote
    pull = pulled_on_ranks(ThreadCollective(2), [str(tmp_path / "node")] * 2, url)[0]
    join = PulledJoin(_GoneCollective(), pull, SimpleNamespace(path=pull.where), "final")
    with pytest.raises(RuntimeError):
        join.exchange(None, pull.where)
    assert not os.path.exists(pull.tmp)
    assert RunStore(str(tmp_path / "node"), RUN).committed() == []


def test_four_ranks_on_two_roots_reshard_a_two_rank_commit_with_overlap(remote, tmp_path):
    url, trained = remote
    roots = [str(tmp_path / "node-a")] * 2 + [str(tmp_path / "node-b")] * 2
    coll = ThreadCollective(4)
    pulls = pulled_on_ranks(coll, roots, url)
    assert [p.puller for p in pulls] == [0, 0, 2, 2]
    for rank, (states, others) in enumerate(read_and_join(coll, pulls, roots)):
        assert others == []
        got, read = read_later(trained.snapshot_path(NEWEST), rank, tracked(), world=4)
        assert got.mode == "reshard"
        assert_equal(states, read(), f"rank {rank}'s moments, resharded")
    assert [RunStore(r, RUN).committed() for r in roots[::2]] == [[NEWEST], [NEWEST]]
