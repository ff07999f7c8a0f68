"""Hot restore: tensors from the daemon's in-memory copy of the latest snapshot.

After a commit the daemon may keep the snapshot's slot in a segment of its own. A
trainer restarted on the same node then reads its tensors from memory instead of
disk. The segment is a hint, like LATEST: it is used only for the snapshot restore()
chose, and each tensor must match the committed manifest (path, dtype, shape, size,
and the xxh3 of its raw bytes) or the object is read from the files instead.
"""

from __future__ import annotations

import mmap
import os
import stat
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from snapd import format as fmt
from snapd.errors import SnapdError
from snapd.plan import from_descriptor
from snapd.reader import SnapshotReader

SHM_DIR = "/dev/shm"


def _map_readonly(name: str) -> mmap.mmap:
    if "/" in name or not name.startswith("snapd-"):
        raise SnapdError(f"hot segment name {name!r} is not a snapd segment")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or not st.st_size:
            raise SnapdError(f"hot segment {name}: not a non-empty file of ours")
        return mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)


def _copy_out(data: memoryview, entry: Dict[str, Any]) -> Optional[torch.Tensor]:
    """The tensor ``entry`` describes, copied from ``data`` and checked; else None."""
    out = torch.empty(len(data), dtype=torch.uint8)
    if len(data):
        np.copyto(out.numpy(), np.frombuffer(data, dtype=np.uint8))
    # Checked after the copy: what is verified is what will be used.
    if fmt.checksum(memoryview(out.numpy())) != entry["xxh3"]:
        return None
    dtype = fmt.DTYPES[entry["dtype"]]
    if not len(data):
        return torch.empty(entry["shape"], dtype=dtype)
    return out.view(dtype).reshape(entry["shape"])


class HotSource:
    """A ``tensor_source`` for restore: serves objects of one held snapshot."""

    def __init__(self, shm: str, snapshot: str, plan: Dict[str, Any]) -> None:
        self.shm, self.snapshot, self.plan = shm, snapshot, plan
        self.hits: List[str] = []
        self.misses: List[str] = []

    @property
    def used(self) -> bool:
        """Every object restore() read came from memory."""
        return bool(self.hits) and not self.misses

    def __call__(self, reader: SnapshotReader, name: str) -> Optional[List[torch.Tensor]]:
        if os.path.basename(reader.path) != self.snapshot:
            return None
        try:
            tensors = self._load(reader.objects[name]["tensors"], name)
        except (OSError, ValueError, KeyError, TypeError, SnapdError):
            tensors = None  # gone, replaced or malformed: the files are the truth
        (self.hits if tensors is not None else self.misses).append(name)
        return tensors

    def _load(self, entries: List[Dict[str, Any]], name: str) -> Optional[List[torch.Tensor]]:
        mapping = _map_readonly(self.shm)
        view = memoryview(mapping)
        try:
            plan = from_descriptor(self.plan, view)  # every offset bounds-checked
            held = next((o for o in plan.objects if o.name == name), None)
            if held is None or len(held.tensors) != len(entries):
                return None
            out = []
            for t, entry in zip(held.tensors, entries):
                if (t.path, t.dtype, list(t.shape), len(t.data)) != \
                        (entry["path"], entry["dtype"], list(entry["shape"]), entry["nbytes"]):
                    return None
                tensor = _copy_out(t.data, entry)
                if tensor is None:
                    return None
                out.append(tensor)
            return out
        finally:
            plan = held = t = None  # drop the slices before the mapping goes
            view.release()
            try:
                mapping.close()
            except BufferError:
                pass  # a slice outlived us; the GC unmaps it
