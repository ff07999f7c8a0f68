"""Moving files between the local disk and a remote root, several at a time.

Object stores answer one request slowly and many at once well, so files go up and
down on a small thread pool; s3fs splits a large file into multipart pieces itself.
A failure of any file fails the call (the caller retries the whole step: every step
of the remote commit rule can be repeated, docs/remote.md).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Optional, Sequence, Tuple

from snapd.errors import RemoteUnavailable

Pairs = Sequence[Tuple[str, str]]          # (source, destination)
Progress = Optional[Callable[[int], None]]  # bytes just moved


def put_files(fs: Any, pairs: Pairs, *, threads: int = 4, sizes: Sequence[int] = (),
              progress: Progress = None, where: str = "") -> None:
    """Upload each local path in ``pairs`` to its remote path."""
    _each(lambda src, dst: fs.put_file(src, dst), pairs, threads, sizes, progress,
          f"uploading to {where}", where)


def get_files(fs: Any, pairs: Pairs, *, threads: int = 4, sizes: Sequence[int] = (),
              progress: Progress = None, where: str = "") -> None:
    """Download each remote path in ``pairs`` to its local path."""
    _each(lambda src, dst: fs.get_file(src, dst), pairs, threads, sizes, progress,
          f"downloading from {where}", where)


def _each(move: Callable[[str, str], Any], pairs: Pairs, threads: int,
          sizes: Sequence[int], progress: Progress, what: str, where: str) -> None:
    sizes = list(sizes) or [0] * len(pairs)

    def one(i: int) -> None:
        move(*pairs[i])
        if progress is not None:
            progress(sizes[i])

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(pairs) or 1)),
                            thread_name_prefix="snapd-remote") as pool:
        futures = [pool.submit(one, i) for i in range(len(pairs))]
        errors: List[BaseException] = []
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # every file finishes or fails before we raise
                errors.append(e)
    if errors:
        first = errors[0]
        if isinstance(first, (OSError, ConnectionError)) or "botocore" in type(first).__module__:
            raise RemoteUnavailable(f"{what}: {len(errors)} of {len(pairs)} files failed, "
                                    f"first: {first!r}; it is retried", path=where,
                                    field="files") from first
        raise first
