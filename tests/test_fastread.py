"""Restore from files into the live tensors, in parallel; all or nothing; weights only."""

from __future__ import annotations

import mmap
import os

import numpy as np
import xxhash
import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

from helpers import flip_byte
from snapd import fastread
from snapd.cli import main
from snapd.errors import CorruptSnapshot
from snapd.reader import SnapshotReader
from snapd_client import Client
from snapd_client.restore import FallbackWarning

RUN = "r"


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train(model, opt):
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    opt.zero_grad()


def make_run(root, steps=(1, 2)):
    """Snapshots in 4 KiB chunks, so that a tensor spans several and a damaged one
    is found after others were read."""
    model, opt = build(0)
    client = Client(root, RUN, data_version="v1", daemon=False, chunk_bytes=4096)
    client.track(model=model, optimizer=opt)
    for step in steps:
        train(model, opt)
        client.snapshot(step).wait()
    client.close()


def snap(root, name):
    return os.path.join(root, RUN, "snapshots", name)


def live_trained(seed=5):
    model, opt = build(seed)
    train(model, opt)   # the optimizer has state to read into
    return model, opt


def resume(root, model, opt):
    client = Client(root, RUN, data_version="v1", daemon=False)
    client.track(model=model, optimizer=opt)
    return client, client.restore()


def state(model, opt):
    """Every tensor of both objects, by path, cloned."""
    out = {f"model{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": v.clone() for k, v in s.items()})
    return out


def saved(root, name):
    """What snapshot ``name`` holds, read by a fresh pair restored from it alone."""
    reader = SnapshotReader(snap(root, name))
    out = {}
    for obj in ("model", "optimizer"):
        for entry, t in zip(reader.objects[obj]["tensors"], reader.load_object(obj)):
            out[entry["path"]] = t
    return out


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def damage_last_chunk(path, obj):
    entry = SnapshotReader(path).objects[obj]
    chunk = entry["tensors"][-1]["chunks"][-1]
    flip_byte(os.path.join(path, entry["file"]), chunk[0] + chunk[1] - 1)


def test_restore_reads_into_the_optimizer_s_own_tensors(root):
    make_run(root)
    model, opt = live_trained()
    moments = {id(p): opt.state[p]["exp_avg"] for p in model.parameters()}
    _, step = resume(root, model, opt)
    assert step == 2
    assert all(opt.state[p]["exp_avg"] is moments[id(p)] for p in model.parameters())
    expected = saved(root, "00000002")
    for i, p in enumerate(model.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], expected[f".state.{i}.exp_avg"])


def test_a_damaged_chunk_after_reads_in_place_ends_exactly_at_the_older_snapshot(root):
    """The newest snapshot's files are read into the live tensors (an older snapshot
    fits, so it can undo that); its optimizer's last chunk is damaged, after the model
    and most of the moments have landed: every object ends as the older snapshot (read
    in place too: the oldest one is its fallback)."""
    make_run(root, steps=(1, 2, 3))
    damage_last_chunk(snap(root, "00000003"), "optimizer")
    model, opt = live_trained()
    moments = {id(p): opt.state[p]["exp_avg"] for p in model.parameters()}
    with pytest.warns(FallbackWarning, match=r"optimizer\.tensors.*checksum"):
        client, step = resume(root, model, opt)
    assert step == 2 and "00000003" in client.restored.refused
    older = saved(root, "00000002")
    assert all(torch.equal(v, older[f".{k}"]) for k, v in model.state_dict().items())
    for i, p in enumerate(model.parameters()):
        assert opt.state[p]["exp_avg"] is moments[id(p)]   # read in place, twice
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], older[f".state.{i}.{key}"])


def test_a_damaged_chunk_with_no_older_snapshot_leaves_every_object_untouched(root):
    make_run(root, steps=(1,))
    damage_last_chunk(snap(root, "00000001"), "optimizer")
    model, opt = live_trained()
    before = state(model, opt)
    with pytest.warns(FallbackWarning), \
            pytest.raises(CorruptSnapshot, match="Every tracked object is untouched"):
        resume(root, model, opt)
    assert same(state(model, opt), before)


def test_warm_start_export_and_diff_need_no_optimizer_file(root, tmp_path):
    make_run(root)
    for name in ("00000001", "00000002"):
        os.unlink(os.path.join(snap(root, name), "optimizer.tensors"))
    model, opt = build(9)
    client = Client(root, RUN, data_version="v1", daemon=False)
    client.track(model=model, optimizer=opt)
    assert client.restore(mode="warm_start") == 0
    assert client.restored.sid.name == "00000002"
    client.close()
    weights = {k[1:]: v for k, v in saved_model(root, "00000002").items()}
    assert same(model.state_dict(), weights)

    out = str(tmp_path / "w.safetensors")
    result = CliRunner().invoke(main, ["export", f"{RUN}/00000002", "-o", out,
                                       "--root", root], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert same(safetensors.torch.load_file(out), weights)
    result = CliRunner().invoke(main, ["diff", f"{RUN}/00000001", f"{RUN}/00000002",
                                       "--object", "model", "--root", root, "--json"],
                                catch_exceptions=False)
    assert result.exit_code == 1 and '"different"' in result.output, result.output


def saved_model(root, name):
    reader = SnapshotReader(snap(root, name), objects=["model"])
    return {e["path"]: t for e, t in zip(reader.objects["model"]["tensors"],
                                         reader.load_object("model"))}


@pytest.fixture
def cold_file(tmp_path):
    """5 blocks of random bytes in a file, none of them cached: (the bytes, a
    FileRead with a direct-I/O descriptor)."""
    path = str(tmp_path / "f")
    data = np.random.default_rng(1).integers(0, 256, 5 * fastread.BLOCK, np.uint8)
    data.tofile(path)
    fd = os.open(path, os.O_RDONLY)
    direct = fastread.open_direct(path, fd)
    if direct is None:
        os.close(fd)
        pytest.skip("this filesystem refuses O_DIRECT")
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    yield data, fastread.FileRead(path, fd, direct, [], [])
    os.close(direct)
    os.close(fd)


def test_direct_reads_land_in_unaligned_destinations_whole(cold_file):
    """Bytes the page cache does not hold come by direct I/O, through the thread's
    aligned buffer when the destination or the length is not a block multiple."""
    data, read = cold_file
    area = memoryview(mmap.mmap(-1, 4 * fastread.BLOCK))
    dst = area[1:1 + 2 * fastread.BLOCK + 100]      # unaligned, not whole blocks
    assert fastread._read_into(read, [dst], fastread.BLOCK) == len(dst)
    assert bytes(dst) == data[fastread.BLOCK:fastread.BLOCK + len(dst)].tobytes()


def test_cold_bytes_through_the_aligned_buffer_are_hashed_as_they_are_copied(cold_file):
    """_read_bounced: a cold, unaligned destination gets its bytes and the zeros after
    it from one direct read, hashed in order; a file that ends before those zeros
    leaves them to the caller's read (which reports the short read)."""
    data, read = cold_file
    area = memoryview(mmap.mmap(-1, 4 * fastread.BLOCK))
    dst = area[64:64 + 2 * fastread.BLOCK + 100]    # as a live tensor sits
    pad = bytearray(fastread.BLOCK - 100)
    hasher = xxhash.xxh3_64()
    at = fastread.BLOCK
    assert fastread._read_bounced(read, dst, pad, at, hasher) == (len(dst), True)
    assert bytes(dst) == data[at:at + len(dst)].tobytes()
    assert bytes(pad) == data[at + len(dst):at + len(dst) + len(pad)].tobytes()
    assert hasher.intdigest() == xxhash.xxh3_64(data[at:at + len(dst)]).intdigest()
    tail = area[64:64 + fastread.BLOCK - 10]          # ends 10 bytes before EOF
    at = 4 * fastread.BLOCK
    assert fastread._read_bounced(read, tail, bytearray(100), at,
                                  xxhash.xxh3_64()) == (len(tail), False)


class Refuses:
    """A tracked object whose load_state_dict raises once ``refuse`` is set: the
    restore's last object fails after the model and the optimizer were loaded."""

    def __init__(self):
        self.refuse = False

    def state_dict(self):
        return {"n": 1}

    def load_state_dict(self, state):
        if self.refuse:
            raise ValueError("refused on purpose")


def state_of(model, opt):
    return [t.clone() for t in model.state_dict().values()] + \
        [t.clone() for s in opt.state.values() for t in s.values()]


def test_a_restore_that_fails_half_way_puts_the_optimizer_back_bit_for_bit(tmp_path):
    """The optimizer's tensors are kept as they were, not copied, before the load
    (torch's load_state_dict replaces them): the put-back still restores them."""
    root = str(tmp_path)
    model, opt = build(0)
    train(model, opt)
    saver = Client(root, RUN, daemon=False)
    saver.track(model=model, optimizer=opt, zz=Refuses())
    saver.snapshot(1).wait()
    saver.close()
    model, opt = build(1)   # another state: what restore would change
    train(model, opt)
    train(model, opt)
    before, refuses = state_of(model, opt), Refuses()
    refuses.refuse = True
    client = Client(root, RUN, daemon=False)
    client.track(model=model, optimizer=opt, zz=refuses)
    with pytest.raises(Exception, match="applying the snapshot failed half way"):
        client.restore()
    after = state_of(model, opt)
    assert len(after) == len(before)
    assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_large_tensors_read_from_files_get_page_aligned_memory():
    """Direct I/O fills them without going through the reader's buffer."""
    from snapd.reader import ALIGNED_FROM, new_tensor
    big = new_tensor([ALIGNED_FROM // 4 + 3], torch.float32)
    assert big.data_ptr() % mmap.PAGESIZE == 0 and big.shape == (ALIGNED_FROM // 4 + 3,)
    big.fill_(1.5)
    assert float(big.sum()) == 1.5 * big.numel()
    small = new_tensor([3, 4], torch.float16)
    assert small.shape == (3, 4) and small.dtype == torch.float16
