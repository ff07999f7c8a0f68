"""restore() on many ranks: every rank restores the same step, or none does.

Restore runs once, at start, on every rank, so it may use collectives; they go over
a private gloo group (snapd_client/ranks.py), as bytes. In order:

1. Refuse without an initialised process group (DistributedNotReady).
2. Let the daemon finish this rank's writes (a snapshot handed over just before a
   kill may still be committing).
3. Rank 0 lists the candidates (restore.py's order: LATEST first, then newest first;
   ``verify_steps`` may put an older one first) and a fresh session token, and
   broadcasts them.
4. Per candidate, every rank checks and reads what it needs, verifying every byte,
   and touches nothing live: at the same world size its own part (a replicated
   tensor from the part that stores it); at another, each sharded tensor's
   overlapping pieces of every saved shard (snapd_client/reshard.py) and the rest
   from old rank ``r % old_world``. The verdicts are all-gathered: all ok, every
   rank applies; a damaged part anywhere, every rank warns (FallbackWarning) naming
   the rank(s) and file(s) refused, and all go to the next candidate; a snapshot
   that does not fit on some rank stops every rank with the same error.
5. None left after refusals: every rank raises the same CorruptSnapshot.

Steps 3 to 5 are snapd_client/agreement.py's; the reading of step 4 is here.

With overlap, step 4 leaves each tracked optimizer's per-parameter state unread
(its size and tiling checked, its bytes not); after the agreement each rank reads its
piece in the background, as step 4 would have (its own part's, or at another world
size assembled from every saved shard that overlaps it), and the ranks join once
before the first update (:func:`_start_overlap`, snapd_client/overlaprestore.py; its
optimizers' files still remote after a pull: snapd_client/remoteranks.py).

Same world size: exact (RNG streams and cursor of the rank's own part). Another
world size: tensors exact, RNG streams left as they are (fresh), the cursor from the
global count of consumed samples, the resume logged as mode "reshard".
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from snapd import format as fmt
from snapd.errors import CorruptSnapshot, DistributedNotReady
from snapd.globalcommit import shard_offset
from snapd.globalsnap import GlobalSnapshot, open_snapshot
from snapd.reader import SnapshotReader, check_name_matches
from snapd.signing import Keys
from snapd.skeleton import unflatten
from snapd.store import SnapshotId
from snapd_client import reshard
from snapd_client.agreement import agree, plan
from snapd_client.cursor import reshard_cursor
from snapd_client.fromremote import pull_for_ranks, pull_from_remote
from snapd_client.overlaprestore import RankJoin
from snapd_client.ranks import Collective, GlooGroup
from snapd_client.remotearrival import later_objects
from snapd_client.remoteranks import PulledJoin, PulledRead, RootPull, shared_pull
from snapd_client.restore import (Loaded, apply, check_candidate, groups_only,
                                  live_tensors, saved_cursor, step_only_names)

logger = logging.getLogger(__name__)


def require_process_group(world_size: int) -> None:
    """Many ranks restore together: that needs the process group first."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return
    raise DistributedNotReady(
        f"restore(): WORLD_SIZE is {world_size} but torch.distributed has no process "
        "group; every rank restores the same snapshot and agrees on it with the others, "
        "so call dist.init_process_group first, then restore()", field="WORLD_SIZE")


# --- the parts of one snapshot ------------------------------------------------------

class Parts:
    """One committed snapshot's parts (snapd/globalsnap.py: each checked against the
    commit record), and the tensors they store, each object file read and verified
    once. A one-rank snapshot is one part."""

    def __init__(self, path: str, check_files: bool = True) -> None:
        self.path = path
        self.snapshot = open_snapshot(path, check_files)
        self.world_size = self.snapshot.world_size \
            if isinstance(self.snapshot, GlobalSnapshot) else 1
        self._stored: Dict[Tuple[int, str], Dict[Tuple[str, Any], torch.Tensor]] = {}

    def part(self, rank: int) -> SnapshotReader:
        if isinstance(self.snapshot, GlobalSnapshot):
            return self.snapshot.part(rank)
        return self.snapshot

    def stored(self, rank: int, name: str) -> Dict[Tuple[str, Any], torch.Tensor]:
        """The tensors rank ``rank``'s part stores for object ``name`` (its refs
        left out), verified, by (path, shard offset)."""
        key = (rank, name)
        if key not in self._stored:
            reader = self.part(rank)
            entries = reader.objects[name]["tensors"]
            self._stored[key] = {(t["path"], shard_offset(t)): v for t, v in
                                 zip(entries, reader.load_object(name)) if v is not None}
        return self._stored[key]

    def tensor(self, rank: int, name: str, t: Dict[str, Any]) -> torch.Tensor:
        """Entry ``t`` of rank ``rank``'s part, read where its bytes lie."""
        holder = t.get("ref", rank)
        found = self.stored(holder, name).get((t["path"], shard_offset(t))) \
            if name in self.part(holder).objects else None
        if found is None or list(found.shape) != list(t["shape"]) or \
                fmt.dtype_name(found.dtype) != t["dtype"]:
            where = os.path.join(self.part(holder).path, fmt.MANIFEST_NAME)
            raise CorruptSnapshot(f"{where}: rank {rank}'s objects.{name}{t['path']} is "
                                  f"stored by rank {holder}, whose part does not hold it "
                                  "alike; use an older snapshot", path=where,
                                  field=f"objects.{name}{t['path']}.ref")
        return found

    def pieces(self, name: str, path: str) -> List[Tuple[reshard.Box, int, Dict[str, Any]]]:
        """Every distinct saved piece of a sharded tensor: (box, rank, entry)."""
        if not isinstance(self.snapshot, GlobalSnapshot):
            return [(_box(t), 0, t) for t in self.part(0).objects[name]["tensors"]
                    if t["path"] == path]
        return [((p.offset, p.shape), p.rank,
                 self.part(p.rank).objects[name]["tensors"][p.index])
                for p in self.snapshot.shards(name, path)]


def _box(t: Dict[str, Any]) -> reshard.Box:
    offset = t["shard"]["offset"] if "shard" in t else [0] * len(t["shape"])
    return tuple(offset), tuple(t["shape"])


def global_view(manifest: Dict[str, Any]) -> Dict[str, Any]:
    """The manifest with each sharded entry's shape the global one: what the live
    objects (DTensors report their global shape) are checked against."""
    objects = {}
    for name, obj in manifest["objects"].items():
        objects[name] = {**obj, "tensors": [
            {**t, "shape": t["shard"]["global_shape"]} if "shard" in t else t
            for t in obj["tensors"]]}
    return {**manifest, "objects": objects}


# --- one rank's reading of one candidate ----------------------------------------------

@dataclass
class Prepared:
    """What one rank read of one candidate: ready to apply, nothing live touched."""

    mode: str                      # "resume" (same world size) or "reshard"
    manifest: Dict[str, Any]       # the part this rank restores from
    states: Dict[str, Any]
    old_world: int
    cursor: Optional[Dict[str, Any]] = None
    rng: Dict[str, bytes] = field(default_factory=dict)
    deferred: Tuple[str, ...] = ()   # optimizers holding param_groups only (overlap)


def prepare(parts: Parts, rank: int, world_size: int, tracked: Dict[str, Any], rng: Any, *,
            data_version: Optional[str], stream: Any, omit: set,
            defer: Iterable[str] = (), keys: Optional[Keys] = None) -> Prepared:
    """Check and read what this rank needs of ``parts`` (CorruptSnapshot when a byte
    fails verification, IncompatibleState when it does not fit). Optimizers in
    ``defer`` are checked like every object, but their per-parameter state is not
    read: their states hold the param_groups only (:func:`deferred_read` reads the
    rest, at this world size or another).
    ``keys`` (snapd/signing.py): the commit record and this rank's part must be signed
    with an accepted key."""
    same = parts.world_size == world_size
    own_rank = rank if same else rank % parts.world_size
    own = parts.part(own_rank)
    if keys is not None and isinstance(parts.snapshot, GlobalSnapshot):
        keys.check(parts.snapshot.record_bytes, what="commit record",
                   path=os.path.join(parts.path, fmt.COMMIT_NAME))
    check_name_matches(parts.path, own.manifest)
    view = copy.copy(own)
    view.manifest = global_view(own.manifest)
    # Resharded, the RNG streams start fresh: theirs are not checked.
    check_omit = omit if same else omit | {f"rng:{n}" for n in rng.names()}
    check_candidate(view, tracked, rng, data_version=data_version,
                    need_cursor=same and stream is not None, omit=check_omit, keys=keys)
    deferred = step_only_names(own, set(defer) - omit)
    states = {name: groups_only(own, name) if name in deferred else
              _read_object(parts, own_rank, name, obj)
              for name, obj in tracked.items() if name not in omit}
    if same:
        return Prepared("resume", own.manifest, states, parts.world_size,
                        own.manifest.get("cursor"), dict(own.manifest["rng"]), deferred)
    cursor = None
    if stream is not None and "cursor" not in omit:
        cursor = _reshard_cursor(own, world_size, stream)
    return Prepared("reshard", own.manifest, states, parts.world_size, cursor, {},
                    deferred)


def _reshard_cursor(own: SnapshotReader, world_size: int, stream: Any) -> Dict[str, Any]:
    saved = saved_cursor(own.manifest, os.path.join(own.path, fmt.MANIFEST_NAME))
    return reshard_cursor(saved, new_world_size=world_size,
                          new_batch_size=getattr(stream.loader, "batch_size", None))


def deferred_read(parts: Parts, rank: int, tracked: Dict[str, Any],
                  names: Iterable[str]) -> Callable[[], Dict[str, Any]]:
    """The background read of the deferred optimizers' state (``names``) on ``rank``:
    what :func:`prepare` would have read, into new memory, every byte verified; at
    another world size each piece assembled from the saved shards that overlap it.
    The layouts wanted (each parameter's DTensor: mesh and placements) are taken here,
    on the trainer's thread; the read itself touches nothing live."""
    own_rank = rank % parts.world_size   # at the same world size, the rank itself
    found = {n: reshard.templates(tracked[n], live_tensors(tracked[n], n)) for n in names}
    return lambda: {n: _read_object(parts, own_rank, n, tracked[n], found[n])
                    for n in names}


def _read_object(parts: Parts, own_rank: int, name: str, obj: Any,
                 found: Optional[Dict[str, Any]] = None) -> Any:
    """Object ``name`` as this rank restores it, from the part of ``own_rank`` (and
    the pieces other parts store); ``found``: the layouts wanted
    (reshard.templates), taken from ``obj`` now when not given."""
    entry = parts.part(own_rank).objects[name]
    source = f"{parts.part(own_rank).path}/{entry.get('file') or fmt.MANIFEST_NAME}"
    if found is None:
        found = reshard.templates(obj, live_tensors(obj, name))
    tensors = [_leaf(parts, own_rank, name, t, found, source) for t in entry["tensors"]]
    state = unflatten(entry["skeleton"], tensors, source=source)
    if entry.get("metadata") is not None:
        state._metadata = unflatten(entry["metadata"], [], source=source)
    return state


def _leaf(parts: Parts, own_rank: int, name: str, t: Dict[str, Any],
          found: Dict[str, Any], source: str) -> Any:
    """One leaf as this rank holds it now: its own saved piece when that is the piece
    it needs (same layout: exact), else assembled from the overlapping pieces."""
    global_shape = t["shard"]["global_shape"] if "shard" in t else t["shape"]
    template = reshard.template_for(t["path"], global_shape, found)
    want = reshard.local_box(template) if template is not None else \
        ((0,) * len(global_shape), tuple(global_shape))
    if _box(t) == want:
        data = parts.tensor(own_rank, name, t)
    else:
        saved = parts.pieces(name, t["path"]) if "shard" in t else [(_box(t), own_rank, t)]
        copies = reshard.overlaps(f"objects.{name}{t['path']}", global_shape,
                                  [box for box, _, _ in saved], want, source=source)
        data_of = {c.piece: parts.tensor(saved[c.piece][1], name, saved[c.piece][2])
                   for c in copies}
        data = reshard.assemble(want[1], fmt.DTYPES[t["dtype"]], data_of, copies)
    return reshard.as_template(data, template) if template is not None else data


# --- the client's side ----------------------------------------------------------------

def restore_ranks(client: Any, omit: set, world_size: int,
                  defer: Iterable[str] = ()) -> Optional[Loaded]:
    """Client.restore() when ``world_size`` > 1: the agreed snapshot, applied on this
    rank (None when the run has none). Sets ``client.session`` to this attempt's.
    ``defer`` (restore(overlap=True)): optimizers whose per-parameter state each rank
    reads in the background, all ranks joined before the first update (see
    :func:`_start_overlap`)."""
    require_process_group(world_size)
    from snapd.progress import read_progress
    # snapd repro: what is committed, at or before its step (snapd_client/repro.py)
    repro = getattr(client, "_repro", None)
    if repro is None:
        client._settle_daemon_writes()
    client.recovery = read_progress(client.store, client.rank)
    # The group is not destroyed here: see GlooGroup.
    coll = GlooGroup()
    pulled, pull = _pull(coll, client, omit, defer) \
        if client.options.remote and repro is None else (set(), None)
    try:
        agreed = agree(coll,
                       lambda: plan(client.store, client.recovery.furthest,
                                    client.options.verify_steps,
                                    at_most=None if repro is None else repro.step,
                                    first=pull and pull.candidate),
                       lambda name: _read_candidate(client, name, omit, world_size,
                                                    set(defer), pull),
                       client.store.snapshots_path)
    except BaseException:
        if pull is not None:   # every rank has left the agreement: nothing reads it
            pull.abandon()
        raise
    if pull is not None:
        pull.after_agreement(agreed.name, agreed.refused)
    client.session = agreed.session
    if not client.read_only:   # each rank checks its own recompute; a divergence names it
        client.journal.world_size = world_size
    if agreed.name is None:
        return None
    client.restored_from = "remote" if agreed.name in pulled else "disk"
    loaded, parts = agreed.prepared
    loaded.refused, loaded.passed_over = agreed.refused, agreed.passed_over
    with client._replacing_arrival():
        _start_overlap(client, loaded, parts, coll,
                       pull if pull is not None and pull.name == agreed.name else None)
        apply(loaded, client._tracked, client.rng, client._stream,
              omit | ({"cursor"} if loaded.manifest["cursor"] is None else set()))
    return loaded


def _pull(coll: Collective, client: Any, omit: set, defer: Iterable[str]
          ) -> Tuple[set, Optional[RootPull]]:
    """The remote tier's newest commit brought onto every root before the agreement
    (fromremote.py); with overlap, in two halves: the snapshot pending on every root
    (snapd_client/remoteranks.py), or None. Returns the names pulled anywhere too."""
    defer = list(defer)
    if not defer:
        return pull_from_remote(coll, client), None
    pulled = pull_for_ranks(coll, client, later_objects(defer, omit))
    return pulled.names, shared_pull(coll, pulled)


def _start_overlap(client: Any, loaded: Loaded, parts: Parts, coll: Collective,
                   pull: Optional[RootPull] = None) -> None:
    """Restore with overlap on many ranks: this rank reads its piece of the deferred
    optimizers' state in the background, through ``parts`` (:func:`deferred_read`: a
    tensor another rank's part stores is read there, and after a reshard each piece
    is assembled from every saved shard that overlaps it, as at restore), verified;
    the first update on each rank waits for it, then every rank exchanges one verdict
    over ``coll`` (overlaprestore.RankJoin): a rank whose read failed makes every rank
    raise at that step, and sets the whole snapshot aside (one directory for all
    ranks: the next start of every rank falls back past it together). Called before
    apply(): the layouts are the live objects' as restore read them."""
    if not loaded.deferred:
        return
    parts._stored.clear()   # what restore read is in ``loaded``: not kept twice
    read = deferred_read(parts, client.rank, client._tracked, loaded.deferred)
    if pull is None:
        client._start_arrival(loaded, None, read=read, join=RankJoin(coll))
        return
    # Its optimizers' files still remote: downloaded first, committed after the join.
    final = client.store.snapshot_path(loaded.sid)
    loaded.path = pull.where
    join = PulledJoin(coll, pull, loaded, final)
    client._start_arrival(loaded, None, said=lambda: join.said, join=join, read=PulledRead(
        pull, coll, read, names=list(loaded.deferred),
        threads=client.options.remote_upload_threads,
        timeout=client.options.remote_timeout))


def _read_candidate(client: Any, name: str, omit: set, world_size: int,
                    defer: set, pull: Optional[RootPull] = None) -> Tuple[Loaded, Parts]:
    """Candidate ``name`` read on this rank; the one ``pull`` has pending is read from
    its root's tmp dir (its later files not there yet: none is stat'ed on open), and
    its damage named by the remote file."""
    if pull is not None and pull.name == name:
        with pull.named():
            return _read_at(client, name, pull.tmp, omit, world_size, defer)
    return _read_at(client, name, client.store.snapshot_path(SnapshotId.parse(name)),
                    omit, world_size, defer)


def _read_at(client: Any, name: str, path: str, omit: set, world_size: int,
             defer: set) -> Tuple[Loaded, Parts]:
    sid = SnapshotId.parse(name)
    parts = Parts(path, check_files=path == client.store.snapshot_path(sid))
    repro = getattr(client, "_repro", None)
    if repro is not None and parts.world_size != world_size:
        repro.refuse(
            f"{path}: snapd repro at world size {world_size}: snapshot {name} was saved "
            f"on {parts.world_size} rank(s), and a step is reproduced exactly only at the "
            f"snapshot's own world size: run the command on {parts.world_size} rank(s)",
            field="world_size")
    prepared = prepare(parts, client.rank, world_size, client._tracked, client.rng,
                       data_version=client.data_version, stream=client._stream, omit=omit,
                       defer=defer, keys=client._keys)
    # restore.apply() takes the RNG streams and cursor from the manifest it is given:
    # resharded, none of the first (fresh) and the cursor recomputed.
    manifest = {**prepared.manifest, "rng": prepared.rng, "cursor": prepared.cursor}
    return Loaded(sid, path, manifest, prepared.states, mode=prepared.mode,
                  old_world_size=prepared.old_world, deferred=prepared.deferred), parts


def begin_reshard(client: Any, loaded: Loaded, omitted: List[str], world_size: int) -> int:
    """Log a resume at another world size: not the same run bit for bit, so no
    replay check; the operator is told so. With overlap the record carries its
    phases as a resume's does (``called``, ``overlap``; a "restored" record follows)."""
    step = loaded.manifest["step"]
    if not client.read_only:
        client.journal.resume(step=step, snapshot=loaded.sid.name, mode="reshard",
                              lineage=client.lineage, reached=client.recovery.furthest,
                              recompute=0, restored_from=client.restored_from,
                              refused=loaded.refused,
                              omitted=omitted, world_size=world_size,
                              old_world_size=loaded.old_world_size,
                              called=client._restore_called,
                              **({"overlap": True} if loaded.deferred else {}))
    arrives = f"; the state of {', '.join(loaded.deferred)} arrives before the first " \
        "step" if loaded.deferred else ""
    logger.info(f"run {client.run}: rank {client.rank}: resharded step {step} saved on "
                f"{loaded.old_world_size} rank(s) onto {world_size}: tensors exact, RNG "
                "streams fresh, the data cursor continued from the global count of "
                f"consumed samples; not an exact resume, so no replay check{arrives}")
    return step
