"""Tensor files in 4096-byte blocks: direct I/O where it can be, the same bytes either way."""

from __future__ import annotations

import errno
import mmap
import os

import pytest

from snapd.blockfile import BLOCK, BlockFile


def direct_io_supported(directory: str) -> bool:
    probe = os.path.join(directory, ".probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    os.close(fd)
    os.unlink(probe)
    return True


def aligned(data: bytes) -> memoryview:
    """``data`` at a page-aligned address (what the staging arena provides)."""
    buf = mmap.mmap(-1, max(len(data), 1))
    buf[:len(data)] = data
    return memoryview(buf)[:len(data)]


RECORDS = [b"head" * 8, os.urandom(3 * BLOCK), os.urandom(2 * BLOCK + 123), b"",
           os.urandom(100)]


def expected_file(records) -> bytes:
    out = b""
    for r in records:
        out += r + bytes(-len(r) % BLOCK)
    return out


def write_records(path: str, records, *, direct=True):
    f = BlockFile(path, direct=direct)
    starts = [f.append(r) for r in records]
    f.sync()
    f.close()
    return f, starts


@pytest.mark.parametrize("source", ["aligned", "unaligned"])
def test_records_land_on_block_boundaries_zero_padded(tmp_path, source):
    records = [aligned(r) if source == "aligned" else r for r in RECORDS]
    path = str(tmp_path / "f")
    f, starts = write_records(path, records)
    data = open(path, "rb").read()
    assert data == expected_file(RECORDS)
    assert starts == [0, BLOCK, 4 * BLOCK, 7 * BLOCK, 7 * BLOCK]
    if source == "unaligned":
        assert f.direct_bytes == 0


def test_aligned_sources_go_by_direct_io_where_the_filesystem_allows(tmp_path):
    if not direct_io_supported(str(tmp_path)):
        pytest.skip(f"{tmp_path}: this filesystem refuses O_DIRECT; the fallback is "
                    "tested on /dev/shm")
    path = str(tmp_path / "f")
    f, _ = write_records(path, [aligned(r) for r in RECORDS])
    # The whole blocks of the two large records; their tails and the rest buffered.
    assert f.direct_bytes == 3 * BLOCK + 2 * BLOCK
    assert open(path, "rb").read() == expected_file(RECORDS)


def test_a_filesystem_refusing_direct_io_at_open_gets_buffered_writes(tmp_path,
                                                                     monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *mode):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # tmpfs before Linux 6.6
        return real_open(path, flags, *mode)

    monkeypatch.setattr(os, "open", refusing_open)
    path = str(tmp_path / "f")
    f, _ = write_records(path, [aligned(r) for r in RECORDS])
    assert f.direct_fd is None and f.direct_bytes == 0
    assert open(path, "rb").read() == expected_file(RECORDS)


def test_direct_writes_refused_midway_fall_back_to_buffered(tmp_path, monkeypatch):
    if not direct_io_supported(str(tmp_path)):
        pytest.skip(f"{tmp_path}: this filesystem refuses O_DIRECT at open; the "
                    "fallback at open is tested above")
    real_pwrite = os.pwrite
    f = BlockFile(str(tmp_path / "f"))
    direct_fd = f.direct_fd

    def refusing_pwrite(fd, data, offset):
        if fd == direct_fd:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refusing_pwrite)
    for r in RECORDS:
        f.append(aligned(r))
    f.sync()
    f.close()
    assert f.direct_fd is None and f.direct_bytes == 0
    assert open(str(tmp_path / "f"), "rb").read() == expected_file(RECORDS)


def test_the_file_is_created_exclusively(tmp_path):
    path = str(tmp_path / "f")
    open(path, "wb").close()
    with pytest.raises(FileExistsError):
        BlockFile(path)
