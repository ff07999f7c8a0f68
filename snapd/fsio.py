"""The durable-write steps: write, fsync the file, rename, fsync the directory.

A rename is atomic but not durable until the directory that holds it is fsynced, and
a file's bytes are not durable until the file is fsynced *before* the rename that
publishes it. Every commit in snapd is built from the functions here, so that each
step is written once.
"""

from __future__ import annotations

import os
import secrets
from typing import Union

Buffer = Union[bytes, bytearray, memoryview]
FILE_MODE = 0o600  # every file snapd writes under a root (docs/format.md)


def fsync_dir(path: str) -> None:
    """Make the entries of a directory (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: Buffer) -> int:
    """os.write until every byte is written (a write may be short)."""
    view = memoryview(data).cast("B")
    total = 0
    while total < len(view):
        total += os.write(fd, view[total:])
    return total


def write_file_durable(path: str, data: Buffer) -> None:
    """Create ``path`` with ``data`` and fsync it (no rename: the caller publishes it).
    Owner-only (FILE_MODE, narrowed further by the umask), like the socket and arenas."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file_atomic(path: str, data: Buffer) -> None:
    """Replace ``path`` so that a reader sees the old bytes or the new, never a mix."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{secrets.token_hex(4)}")
    try:
        write_file_durable(tmp, data)         # 1. new bytes durable under a private name
        os.replace(tmp, path)                 # 2. atomic switch
    except BaseException:
        _unlink_quietly(tmp)
        raise
    fsync_dir(directory)                      # 3. the switch itself durable


def publish_directory(tmp_dir: str, final_dir: str) -> None:
    """Rename a fully written directory into place and make the rename durable."""
    os.rename(tmp_dir, final_dir)
    fsync_dir(os.path.dirname(final_dir) or ".")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
