"""Opening the files of a snapshot without trusting them: never through a symlink,
never blocking (a FIFO or device planted under a snapshot's name would hang the open
or the read), and the small files snapd writes (manifests, commit records) read only
up to the largest size snapd ever writes.

Below the reader and the sharing rules, which both open manifests, so that neither
imports the other for it.
"""

from __future__ import annotations

import os
import stat

from snapd import format as fmt
from snapd.errors import CorruptSnapshot


def open_regular(path: str) -> int:
    """A read-only descriptor of a regular file, never following a symlink and never
    blocking: a FIFO or device planted under a snapshot's name would otherwise hang
    the open (a FIFO waits for a writer) or the read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise CorruptSnapshot(f"{path}: listed in the manifest but missing",
                              path=path, field="files") from e
    except OSError as e:
        raise CorruptSnapshot(f"{path}: cannot be opened as a plain file ({e}); the "
                              "snapshot is damaged or hostile, use an older one",
                              path=path, field="files") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptSnapshot(f"{path}: not a regular file (a FIFO, device or "
                              "directory); the snapshot is damaged or hostile, use an "
                              "older one", path=path, field="files")
    return fd


def read_manifest_bytes(snapshot_dir: str) -> bytes:
    """The bytes of a snapshot's manifest, size-bounded, from a regular file."""
    return read_bounded(os.path.join(snapshot_dir, fmt.MANIFEST_NAME), "manifest")


def read_bounded(path: str, what: str) -> bytes:
    """A small file snapd wrote (a manifest, a commit record), refused unread when it
    is larger than any such file can be."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > fmt.MAX_MANIFEST_BYTES:
            raise CorruptSnapshot(f"{path}: {size} bytes, larger than any {what} snapd "
                                  "writes", path=path, field="size")
        return os.read(fd, size + 1)
    finally:
        os.close(fd)
