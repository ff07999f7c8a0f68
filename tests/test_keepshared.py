"""Files shared between snapshots of a run: kept when their snapshot is deleted or set
aside, swept when no committed snapshot reads them (snapd/keepshared.py), and what
gc, ls, inspect and verify say of them."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from click.testing import CliRunner

from snapd import keepshared, sharing
from snapd.cli import main
from snapd.commit import uncommit
from snapd.commands.verify import checked_text
from snapd.errors import SnapdError
from snapd.options import Options
from snapd.reader import SnapshotReader
from snapd.retention import DELETING_PREFIX, apply_retention, gc
from snapd.rootlock import RootLock
from snapd.runlock import RunLock
from snapd.store import DAMAGED_PREFIX, RunStore, SnapshotId
from snapd.humanize import human_bytes
from snapd.writer import write_snapshot
from snapd_client import Client

from helpers import plan_for
from sharedsnaps import (MODEL_FILE, RUN, age, manifest_of, resolved, tree, verify_all,
                         write_plain, write_sharing)

S1, S2, S3 = (SnapshotId(0, s) for s in (1, 2, 3))


@pytest.fixture
def store(root):
    s = RunStore(root, RUN)
    s.ensure()
    return s


@pytest.fixture
def shared_run(store):
    """S1 plain; S2 reads S1's model file. Returns S1's model bytes."""
    write_plain(store, 1)
    write_sharing(store, 2, 1)
    with open(os.path.join(store.snapshot_path(S1), MODEL_FILE), "rb") as f:
        return f.read()


def kept_path(store, sid=S1, file=MODEL_FILE):
    return sharing.shared_path(store.path, sid.name, file)


def cli(*args):
    return CliRunner().invoke(main, list(args), env={"COLUMNS": "200"},
                              catch_exceptions=False)


# --- retention keeps what a kept snapshot reads, and sweeps what none does -------------

def test_deleting_a_snapshot_keeps_the_file_a_kept_one_reads(store, shared_run):
    result = apply_retention(store, Options(keep_last=1))
    assert result.deleted == ["00000001"] and store.committed() == [S2]
    assert result.kept_shared == ["00000001/model.tensors"]
    assert os.listdir(os.path.dirname(kept_path(store))) == [MODEL_FILE]   # not opt's
    assert resolved(store) == {"00000002": {"00000001/model.tensors": shared_run}}
    assert verify_all(store) == ["00000002"]
    assert os.stat(os.path.dirname(kept_path(store))).st_mode & 0o077 == 0


def test_deleting_the_last_reader_sweeps_the_kept_file(store, shared_run):
    apply_retention(store, Options(keep_last=1))
    write_plain(store, 3)
    age(kept_path(store))
    result = apply_retention(store, Options(keep_last=1))
    assert result.deleted == ["00000002"] and store.committed() == [S3]
    assert result.swept == ["00000001/model.tensors"]
    assert result.swept_bytes == len(shared_run)      # its last name: freed
    assert not os.path.exists(os.path.dirname(kept_path(store)))


def test_a_reader_deleted_in_the_same_pass_needs_no_kept_file(store, shared_run):
    write_plain(store, 3)
    result = apply_retention(store, Options(keep_last=1))
    assert result.deleted == ["00000001", "00000002"]
    assert result.kept_shared == [] and result.swept == []
    assert not os.path.exists(os.path.join(store.path, sharing.SHARED_DIR))


def test_a_young_unreferenced_file_is_left_for_a_later_sweep(store, shared_run):
    # What a pull of a remote snapshot brought down before committing it.
    pulled = sharing.shared_path(store.path, "00000000", MODEL_FILE)
    os.makedirs(os.path.dirname(pulled))
    open(pulled, "wb").close()
    assert keepshared.sweep(store).files == [] and os.path.exists(pulled)
    age(pulled)
    assert keepshared.sweep(store).files == ["00000000/model.tensors"]
    assert not os.path.exists(os.path.dirname(pulled))


def test_a_chain_of_readers_keeps_the_first_file(store, shared_run):
    write_sharing(store, 3, 2)   # reads S1's file too, through S2's shared list
    apply_retention(store, Options(keep_last=1))
    assert store.committed() == [S3]
    assert resolved(store) == {"00000003": {"00000001/model.tensors": shared_run}}
    assert verify_all(store) == ["00000003"]


def test_what_the_writer_refers_to_survives_retention(store):
    base = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    for step in (1, 2, 3):   # base unchanged: written once, then referred to
        write_snapshot(store, plan_for({"base": base, "head": torch.full((8,), step * 1.0)},
                                       step=step, frozen=True), Options(chunk_bytes=4096))
    assert sharing.references(manifest_of(store.snapshot_path(S3))) == \
        {("00000001", MODEL_FILE)}
    apply_retention(store, Options(keep_last=1))
    assert verify_all(store) == ["00000003"]
    reader = SnapshotReader(store.snapshot_path(S3))
    assert torch.equal(reader.load_object("model")[0], base)


def test_a_fine_tuning_run_keeps_its_frozen_base_through_retention(root):
    torch.manual_seed(0)
    base, head = torch.nn.Linear(64, 64), torch.nn.Linear(64, 2)
    base.requires_grad_(False)
    model = torch.nn.Sequential(base, head)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    client = Client(root, RUN, daemon=False, keep_last=1)
    client.track(model=model, optimizer=opt)
    for step in range(1, 4):   # 3 reads the base from 1's file, kept in shared/
        opt.zero_grad()
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        client.snapshot(step).wait()
    client.close()
    store = RunStore(root, RUN)
    assert store.committed() == [S3]
    assert sharing.references(manifest_of(store.snapshot_path(S3))) == \
        {("00000001", MODEL_FILE)}
    assert os.path.exists(kept_path(store)) and verify_all(store) == ["00000003"]
    restored = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
    reader = Client(root, RUN, read_only=True)
    reader.track(model=restored)
    reader.restore(mode="warm_start")   # the weights only
    reader.close()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 restored.state_dict().values()))


def test_setting_a_snapshot_aside_keeps_what_others_read(store, shared_run):
    aside = uncommit(store, S1, DAMAGED_PREFIX)
    assert os.path.basename(aside).startswith(".damaged-00000001-")
    assert store.committed() == [S2]
    assert resolved(store)["00000002"] == {"00000001/model.tensors": shared_run}
    assert verify_all(store) == ["00000002"]


def test_an_unreadable_manifest_keeps_every_file_and_stops_the_sweep(store, shared_run):
    os.makedirs(os.path.join(store.path, sharing.SHARED_DIR, "00000000"))
    orphan = os.path.join(store.path, sharing.SHARED_DIR, "00000000", MODEL_FILE)
    open(orphan, "wb").close()
    damaged = store.snapshot_path(S3)
    os.mkdir(damaged)
    with open(os.path.join(damaged, "manifest.snapd"), "wb") as f:
        f.write(b"a manifest of a format this snapd cannot read")
    result = apply_retention(store, Options(keep_last=1))
    assert result.refused == ["00000003"] and result.deleted == ["00000001"]
    # S3 might read any of S1's files: both kept; and any shared file: none swept.
    assert sorted(os.listdir(os.path.dirname(kept_path(store)))) == [MODEL_FILE,
                                                                      "opt.tensors"]
    assert result.sweep_blocked_by == ["00000003"] and os.path.exists(orphan)


# --- keep_referenced: links, crash leftovers, hostile entries ------------------------

def test_keeping_twice_is_one_link(store, shared_run):
    assert keepshared.keep_referenced(store, S1) == [MODEL_FILE]
    assert keepshared.keep_referenced(store, S1) == [MODEL_FILE]
    source = os.path.join(store.snapshot_path(S1), MODEL_FILE)
    assert os.path.samefile(source, kept_path(store)) and os.stat(source).st_nlink == 2


def test_another_file_under_the_kept_name_is_replaced(store, shared_run):
    os.makedirs(os.path.dirname(kept_path(store)))
    with open(kept_path(store), "wb") as f:
        f.write(b"stale bytes of an earlier snapshot of that name")
    keepshared.keep_referenced(store, S1)
    assert os.path.samefile(os.path.join(store.snapshot_path(S1), MODEL_FILE),
                            kept_path(store))
    assert os.listdir(os.path.dirname(kept_path(store))) == [MODEL_FILE]  # no tmp name


def test_without_hard_links_the_file_is_copied(store, shared_run, monkeypatch):
    def no_links(source, dest):
        raise OSError(errno.EPERM, "Operation not permitted", source)
    monkeypatch.setattr(os, "link", no_links)   # a filesystem without hard links
    apply_retention(store, Options(keep_last=1))
    assert resolved(store)["00000002"] == {"00000001/model.tensors": shared_run}
    assert verify_all(store) == ["00000002"]
    assert os.listdir(os.path.dirname(kept_path(store))) == [MODEL_FILE]
    assert os.stat(kept_path(store)).st_mode & 0o777 == 0o600


def test_a_symlink_at_shared_is_refused_and_nothing_is_deleted(store, shared_run, root):
    elsewhere = os.path.join(os.path.dirname(root), "outside")
    os.symlink(elsewhere, os.path.join(store.path, sharing.SHARED_DIR))
    with pytest.raises(SnapdError) as refused:
        uncommit(store, S1, DELETING_PREFIX)
    assert refused.value.field == "shared"
    assert store.committed() == [S1, S2] and os.listdir(elsewhere) == []


def test_the_sweep_touches_only_what_snapd_makes(store, shared_run, root):
    apply_retention(store, Options(keep_last=1))
    top = os.path.join(store.path, sharing.SHARED_DIR)
    outside = os.path.join(os.path.dirname(root), "outside")
    open(os.path.join(outside, "theirs"), "wb").close()
    os.makedirs(os.path.join(top, "notes"))
    open(os.path.join(top, "notes", MODEL_FILE), "wb").close()
    open(os.path.join(top, "README"), "wb").close()
    os.symlink(outside, os.path.join(top, "00000009"))
    stale = os.path.join(top, "00000005")
    os.makedirs(os.path.join(stale, "nested"))
    for name in (MODEL_FILE, ".tmp-model.tensors-dead"):
        open(os.path.join(stale, name), "wb").close()
    os.symlink(os.path.join(outside, "theirs"), os.path.join(stale, "link.tensors"))
    age(*(os.path.join(stale, n) for n in os.listdir(stale)))
    swept = keepshared.sweep(store)
    assert swept.files == ["00000005/.tmp-model.tensors-dead", "00000005/link.tensors",
                           "00000005/model.tensors"]
    assert os.listdir(stale) == ["nested"]
    assert sorted(os.listdir(top)) == ["00000001", "00000005", "00000009", "README",
                                       "notes"]
    assert os.listdir(outside) == ["theirs"] and os.listdir(os.path.join(top, "notes"))
    assert resolved(store)["00000002"]   # still reads S1's file


# --- snapd gc --------------------------------------------------------------------------

def test_gc_dry_run_reports_what_it_would_keep_and_sweep_and_changes_nothing(
        store, shared_run, root):
    write_plain(store, 3)
    write_sharing(store, 4, 3)
    os.makedirs(os.path.join(store.path, sharing.SHARED_DIR, "00000000"))
    with open(os.path.join(store.path, sharing.SHARED_DIR, "00000000", MODEL_FILE),
              "wb") as f:
        f.write(b"x" * 100)
    age(os.path.join(store.path, sharing.SHARED_DIR, "00000000", MODEL_FILE))
    before = tree(root)
    out = cli("gc", "--root", root, "--keep-last", "1", "--dry-run", "--json")
    assert out.exit_code == 0, out.output
    r = json.loads(out.output)["runs"][RUN]
    assert r["deleted"] == ["00000001", "00000002", "00000003"]
    assert r["kept_shared"] == ["00000003/model.tensors"]
    assert r["swept"] == ["00000000/model.tensors"] and r["swept_bytes"] == 100
    assert tree(root) == before
    text = cli("gc", "--root", root, "--keep-last", "1", "--dry-run").output
    assert "would keep" in text and "00000003/model.tensors" in text
    assert "would sweep 100 B from shared/" in text
    assert tree(root) == before
    done = json.loads(cli("gc", "--root", root, "--keep-last", "1", "--json").output)
    assert {k: done["runs"][RUN][k] for k in ("deleted", "kept_shared", "swept",
                                                "bytes", "kept_shared_bytes")} == \
        {k: r[k] for k in ("deleted", "kept_shared", "swept", "bytes", "kept_shared_bytes")}
    assert resolved(store) == {"00000004": {"00000003/model.tensors": open(
        kept_path(store, S3), "rb").read()}}


def test_gc_reports_freed_bytes_without_the_kept_file(store, shared_run):
    s1 = store.snapshot_path(S1)
    whole = sum(os.path.getsize(os.path.join(s1, n)) for n in os.listdir(s1))
    [result] = gc(store.root, Options(keep_last=1)).values()
    assert result.kept_shared_bytes == len(shared_run)
    assert result.bytes == whole - len(shared_run)


def test_gc_is_refused_while_a_daemon_serves_the_root(store, shared_run, root):
    with RootLock(root):   # what a serving daemon holds
        out = cli("gc", "--root", root, "--keep-last", "1")
        assert out.exit_code == 1 and "--dry-run works beside it" in out.output
        assert cli("gc", "--root", root, "--keep-last", "1", "--dry-run").exit_code == 0
    assert store.committed() == [S1, S2]


def test_gc_leaves_a_run_a_live_client_writes(store, shared_run, root):
    lock = RunLock(store.path, RUN, 0)
    lock.acquire()
    try:
        out = cli("gc", "--root", root, "--keep-last", "1")
    finally:
        lock.release()
    assert out.exit_code == 0 and "left alone, a live client writes" in out.output
    assert store.committed() == [S1, S2]


# --- ls, inspect, verify: owned and shared bytes --------------------------------------

def test_ls_shows_owned_and_shared_bytes(store, shared_run, root):
    rows = {r["name"]: r for r in json.loads(cli("ls", RUN, "--root", root,
                                                 "--json").output)["snapshots"]}
    m1, m2 = manifest_of(store.snapshot_path(S1)), manifest_of(store.snapshot_path(S2))
    model_chunks = sum(c[1] for t in m1["objects"]["model"]["tensors"] for c in t["chunks"])
    assert rows["00000001"]["owned_bytes"] == sum(f["size"] for f in m1["files"].values())
    assert rows["00000001"]["shared_bytes"] == 0
    assert rows["00000002"]["owned_bytes"] == sum(f["size"] for f in m2["files"].values())
    assert rows["00000002"]["shared_bytes"] == model_chunks
    assert rows["00000002"]["shared_with"] == ["00000001"]
    table = cli("ls", RUN, "--root", root).output.splitlines()
    header = next(line for line in table if "snapshot" in line).split()
    assert header[header.index("size") + 1] == "shared"
    row = next(line for line in table if "00000002" in line)
    assert human_bytes(model_chunks) in row


def test_inspect_shows_what_a_snapshot_reads_from_another(store, shared_run, root):
    info = json.loads(cli("inspect", f"{RUN}/2", "--root", root, "--json").output)
    assert info["shared_with"] == ["00000001"] and info["shared_bytes"] > 0
    assert info["owned_bytes"] == info["bytes"]
    tensors = info["objects"]["model"]["tensors"]
    assert {t["shared_from"] for t in tensors} == {"00000001/model.tensors"}
    assert info["objects"]["opt"]["tensors"][0]["shared_from"] is None
    text = cli("inspect", f"{RUN}/2", "--root", root).output
    assert "of 00000001's files" in text and "00000001/model.tensors" in text


def test_verify_counts_the_shared_chunks_it_checked(store, shared_run, root):
    apply_retention(store, Options(keep_last=1))   # S1's file now only in shared/
    data = json.loads(cli("verify", f"{RUN}/2", "--root", root, "--json").output)
    [r] = data["snapshots"]
    m = manifest_of(store.snapshot_path(S2))
    shared = sum(c[1] for t in m["objects"]["model"]["tensors"] for c in t["chunks"])
    assert r["ok"] and r["shared_bytes"] == shared and r["shared_with"] == ["00000001"]
    assert r["bytes"] == r["owned_bytes"] + shared
    text = cli("verify", f"{RUN}/2", "--root", root).output
    assert "of them shared with 00000001" in text


def test_verify_says_how_much_it_checked_was_shared():
    assert checked_text({"bytes": 3 << 20, "shared_bytes": 1 << 20,
                         "shared_with": ["00000001"]}) == \
        "3.0 MiB checked, 1.0 MiB of them shared with 00000001"
    assert checked_text({"bytes": 2048, "shared_bytes": 0}) == "2.0 KiB checked"
