"""Staging: the arena (layout, bit-exact copies, reuse, growth, cleanup) and the
stager (copy order, the fence, the overlap thread, synchronize)."""

from __future__ import annotations

import os
import stat
import threading

import pytest
import torch

from snapd.errors import SnapdError
from snapd_client import staging
from snapd_client.staging import ALIGN, Arena, Stager, copy_order, layout, slot_size_for


def raw(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def staged(arena: Arena, slot: int, t: torch.Tensor, off: int) -> bytes:
    n = t.numel() * t.element_size()
    return arena.view(slot, off, n).numpy().tobytes()


def awkward_tensors():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=gen)
    return [
        torch.randn(3, 5, generator=gen).to(torch.bfloat16),   # bf16
        base.t(),                                              # non-contiguous
        base[::2, 1::3],                                       # strided slice
        torch.tensor(7.25, dtype=torch.float64),               # 0-dim
        torch.empty(0, 4),                                     # empty
        torch.arange(9, dtype=torch.int16),                    # odd byte count
        torch.tensor([True, False, True]),
        torch.randn(2, 3, dtype=torch.complex64, generator=gen).conj(),  # conj view
        torch.randn(4, generator=gen, requires_grad=True),     # a parameter's kind
    ]


@pytest.fixture
def arena():
    a = Arena(1 << 16, slots=2)
    yield a
    a.close()


def test_allocation_is_one_private_file_of_whole_pages(arena):
    st = os.stat(arena.path)
    assert arena.path == os.path.join(staging.SHM_DIR, arena.name)
    assert arena.name.startswith(f"snapd-{os.getuid()}-{os.getpid()}-")
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == arena.size == 2 * arena.slot_bytes
    assert arena.slot_bytes % 4096 == 0
    # Faulted in at allocation: every page is resident (tmpfs blocks are allocated).
    assert st.st_blocks * 512 >= arena.size


def test_layout_aligns_small_tensors_to_64_bytes_and_large_ones_to_blocks():
    ts = [torch.zeros(3, dtype=torch.uint8), torch.zeros(5), torch.zeros(0),
          torch.zeros((), dtype=torch.float64), torch.zeros(1025),
          torch.zeros(17, dtype=torch.int16), torch.zeros(4096, dtype=torch.uint8)]
    offsets, need = layout(ts)
    assert all(off % ALIGN == 0 for off in offsets)
    assert offsets[1] == 64 and offsets[5] % 4096 != 0  # small ones stay packed
    assert offsets[4] % 4096 == 0 and offsets[6] % 4096 == 0  # direct I/O sources
    ends = [off + t.numel() * t.element_size() for off, t in zip(offsets, ts)]
    assert all(ends[i] <= offsets[i + 1] for i in range(len(ts) - 1))
    assert need == ends[-1]


def test_stage_copies_bit_for_bit(arena):
    ts = awkward_tensors()
    offsets, need = layout(ts)
    assert need <= arena.slot_bytes
    arena.stage(1, ts, offsets)
    arena.wait()
    for t, off in zip(ts, offsets):
        assert staged(arena, 1, t, off) == raw(t.resolve_conj())
    # Slot 0 is untouched: slots are disjoint.
    assert not arena.view(0, 0, arena.slot_bytes).any()


def test_staging_does_not_track_gradients(arena):
    p = torch.nn.Parameter(torch.randn(8))
    offsets, _ = layout([p])
    arena.stage(0, [p], offsets)
    assert p.grad is None and not arena.view(0, 0, 32).requires_grad


def test_reuse_keeps_the_same_file_and_mapping(arena):
    name, ptr = arena.name, arena.view(0, 0, 1).data_ptr()
    for i in range(5):
        t = torch.full((100,), float(i))
        offsets, _ = layout([t])
        arena.stage(i % 2, [t], offsets)
        assert staged(arena, i % 2, t, 0) == raw(t)
    assert (arena.name, arena.view(0, 0, 1).data_ptr()) == (name, ptr)
    assert [f for f in os.listdir(staging.SHM_DIR) if f.startswith(
        f"snapd-{os.getuid()}-{os.getpid()}-")] == [name]


def test_outside_a_slot_is_refused(arena):
    with pytest.raises(SnapdError, match="outside"):
        arena.view(0, arena.slot_bytes - 8, 16)
    with pytest.raises(SnapdError, match="outside"):
        arena.view(2, 0, 1)


def test_growth_sizes_a_new_arena_for_the_need():
    small = Arena(slot_size_for(1000))
    big_tensor = torch.randn(small.slot_bytes // 4 + 1)
    offsets, need = layout([big_tensor])
    assert need > small.slot_bytes
    big = Arena(slot_size_for(need))
    try:
        assert big.slot_bytes >= need and big.name != small.name
        big.stage(0, [big_tensor], offsets)
        assert staged(big, 0, big_tensor, 0) == raw(big_tensor)
    finally:
        small.close()
        big.close()
    assert not os.path.exists(small.path) and not os.path.exists(big.path)


def test_close_unmaps_and_unlinks_and_is_idempotent():
    a = Arena(4096)
    t = torch.arange(10.0)
    a.stage(0, [t], [0])
    a.close()
    assert a.closed and not os.path.exists(a.path)
    a.close()
    with pytest.raises(SnapdError, match="closed"):
        a.view(0, 0, 1)


def test_a_full_shm_is_an_error_not_a_crash(monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(staging.os, "posix_fallocate", no_space)
    from snapd.errors import InsufficientSpace
    with pytest.raises(InsufficientSpace, match="staging arena"):
        Arena(1 << 20)
    assert not [f for f in os.listdir(staging.SHM_DIR)
                if f.startswith(f"snapd-{os.getuid()}-{os.getpid()}-")]


@pytest.fixture
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def copiers(monkeypatch):
    """The names of the threads that ran the shared piece copy."""
    names = []
    real = staging._copy_some

    def recording(pieces, counter):
        names.append(threading.current_thread().name)
        real(pieces, counter)
    monkeypatch.setattr(staging, "_copy_some", recording)
    return names


def test_shared_pieces_copy_bit_for_bit_with_helpers(one_torch_thread, copiers):
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(5 * staging.PIECE_BYTES // 4 + 13, generator=gen)  # 6 pieces
    ts = [big, torch.randn(1000, generator=gen).to(torch.bfloat16)] + awkward_tensors()
    offsets, need = layout(ts)
    a = Arena(slot_size_for(need), slots=2, copy_threads=3)
    try:
        a.stage(1, ts, offsets)
        for t, off in zip(ts, offsets):
            assert staged(a, 1, t, off) == raw(t.resolve_conj())
        assert not a.view(0, 0, a.slot_bytes).any()
    finally:
        a.close()
    assert threading.current_thread().name in copiers
    assert any(n.startswith("snapd-copy") for n in copiers)  # a helper took part


def test_no_helpers_in_the_background_or_beside_torch_threads(copiers):
    big = torch.randn(3 * staging.PIECE_BYTES // 4)
    offsets, need = layout([big])
    a = Arena(slot_size_for(need), copy_threads=4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)   # torch's own threads split copy_: no helpers
        a.stage(0, [big], offsets)
        assert staged(a, 0, big, 0) == raw(big) and copiers == []
        torch.set_num_threads(1)
        big.add_(1)
        a.stage(0, [big], offsets, share=False)   # overlap mode's background copy
        assert staged(a, 0, big, 0) == raw(big) and copiers == []
    finally:
        torch.set_num_threads(before)
        a.close()


def test_copy_threads_must_be_positive():
    with pytest.raises(ValueError, match="copy_threads=0"):
        Arena(4096, copy_threads=0)
    from snapd.options import Options
    with pytest.raises(ValueError, match="copy_threads=0"):
        Options(copy_threads=0)


class StandIn:
    """Stands for a tensor where only its device is read (no GPU on CI)."""

    def __init__(self, is_cuda: bool) -> None:
        self.is_cuda = is_cuda


def test_deferred_device_copies_are_enqueued_after_all_the_others():
    """Overlap mode fences the compute stream after the copies the next forward may
    race (buffers); the parameters' and moments' copies must come after the fence."""
    cuda_param, cpu_buffer, cpu_param, cuda_buffer = (
        StandIn(True), StandIn(False), StandIn(False), StandIn(True))
    now, device_later, later = copy_order(
        [cuda_param, cpu_buffer, cpu_param, cuda_buffer], [0, 64, 128, 192],
        [True, False, True, False])
    assert now == [(cpu_buffer, 64), (cuda_buffer, 192)]
    assert device_later == [(cuda_param, 0)]
    assert later == [(cpu_param, 128)]


class RecordingArena:
    """Records the stager's calls; ``gate`` holds the background copy back."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list = []
        self.fail = fail
        self.gate = threading.Event()
        self.gate.set()

    def stage(self, slot, tensors, offsets, **kwargs):
        if kwargs.get("share") is False:  # the stager's own thread
            self.gate.wait()
            if self.fail:
                raise OSError("copy failed")
        self.calls.append(("stage", slot, list(offsets), kwargs.get("share", True)))

    def fence(self):
        self.calls.append(("fence",))

    def wait(self):
        self.calls.append(("wait",))


def stage(stager, arena, slot, deferred, offsets, landed):
    stager.stage(arena, slot, [torch.ones(4) for _ in deferred], offsets, deferred, landed)


@pytest.mark.parametrize("mode", ["wait", "overlap"])
def test_the_fence_sits_between_the_two_stagings_in_overlap_mode_only(mode):
    stager, arena, landed = Stager(mode), RecordingArena(), []
    stage(stager, arena, 1, [True, False], [0, 64], landed.append)
    stager.drain()
    if mode == "overlap":
        assert arena.calls == [("stage", 1, [64], True), ("fence",), ("stage", 1, [], True),
                               ("stage", 1, [0], False), ("wait",)]
    else:  # nothing deferred: one copy of everything, waited for before stage() returns
        assert arena.calls == [("stage", 1, [0, 64], True), ("stage", 1, [], True),
                               ("wait",)]
    assert landed == [None]


def test_overlap_returns_before_the_deferred_copy_and_synchronize_waits_for_it():
    stager, arena, landed = Stager("overlap"), RecordingArena(), []
    arena.gate.clear()   # the background copy cannot finish yet
    stage(stager, arena, 0, [True, False], [0, 64], landed.append)
    assert ("stage", 0, [0], False) not in arena.calls and landed == []
    waiter = threading.Thread(target=stager.synchronize)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "synchronize() returned before the copy landed"
    arena.gate.set()
    waiter.join(10)
    assert not waiter.is_alive()
    assert arena.calls[-2:] == [("stage", 0, [0], False), ("wait",)]
    stager.drain()
    assert landed == [None]


def test_a_failed_background_copy_reaches_landed_and_frees_synchronize():
    stager, arena, landed = Stager("overlap"), RecordingArena(fail=True), []
    stage(stager, arena, 0, [True], [0], landed.append)
    stager.synchronize()
    stager.drain()
    assert len(landed) == 1 and isinstance(landed[0], OSError)


def test_wait_mode_copies_and_submits_before_stage_returns():
    """wait mode: the submit (landed) is sent on the caller's thread before stage()
    returns, so a trainer killed right after snapshot() returned has handed it off."""
    stager, arena, threads = Stager("wait"), RecordingArena(), []
    stage(stager, arena, 0, [True], [0],
          lambda error: threads.append((threading.current_thread(), error)))
    assert arena.calls[-1] == ("wait",)   # every copy has landed when stage() returns
    assert threads == [(threading.current_thread(), None)]   # and landed has run, here
    stager.drain()
    assert len(threads) == 1


def test_a_refused_page_lock_warns_once_and_staging_goes_on(monkeypatch, arena):
    """Some runtimes refuse cudaHostRegister; snapshots must still be taken."""
    calls = []

    class Runtime:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", size))
            return 1  # cudaErrorInvalidValue

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister",))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    with pytest.warns(RuntimeWarning, match=f"{arena.path}.*synchronous"):
        arena._register()
    assert calls == [("register", arena.size)]
    assert arena._register_tried and not arena._registered
    arena.close()
    assert ("unregister",) not in calls, "nothing was registered"
