"""The resumable batch stream that ``Client.batches(loader)`` returns.

snapd owns the iteration for two reasons. It counts the batches the loop has
*consumed* (``epoch``, ``index``), not those the workers prefetched. And creating an
epoch's iterator draws random numbers (the workers' base seed, ``RandomSampler``'s
shuffle seed), so each epoch opens by capturing every RNG stream just before
``iter(loader)``: the *epoch-start RNG*. :meth:`BatchStream.load` puts those states
back, recreates the epoch iterator positioned at ``index``, then returns every stream
to where it found it: opening the epoch draws what it drew the first time, and the
caller's restored streams are untouched, whichever of the two is restored first.

Positioning (``last_fast_forward["mode"]``; docs/cursor.md says what is exact when):
``skip`` for a map-style ``DataLoader``: for one ``iter(loader)`` its index sampler is
replaced by one that first advances ``index`` steps, so no consumed sample is fetched
or sent to a worker. ``loader_state`` for a loader with ``state_dict()`` (torchdata's
``StatefulDataLoader``). ``replay`` otherwise, or when asked: fetch and discard the
epoch's consumed batches, the only exact way when a ``DataLoader``'s workers draw.

Before each epoch's ``iter(loader)`` (a resumed one too) the stream calls
``set_epoch(epoch)`` on the loader's sampler that has it (``DistributedSampler``), so
each epoch is shuffled anew on every rank. The cursor records the job's world size
and the loader's batch size: :func:`reshard_cursor` turns a cursor saved at one world
size into one for another, from the global count of samples consumed.
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset

from snapd.errors import CorruptSnapshot, IncompatibleState, InvalidOption, UnsupportedState

from .rng import RngState, RngStreams
from .wrapped_loaders import check_wrapped, drop_pending, opened_with, sampling_loader

FAST_FORWARD_MODES = ("skip", "replay")
STATE_VERSION = 1
_TENSOR = "__snapd_tensor__"


def to_plain(value: Any, path: str = "loader_state") -> Any:
    """A copy of ``value`` that msgpack carries: each tensor becomes
    ``{"__snapd_tensor__": True, "dtype", "shape", "data": raw bytes}``, tuples lists."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        return {_TENSOR: True, "dtype": str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape), "data": flat.view(torch.uint8).numpy().tobytes()}
    if isinstance(value, dict):
        return {k: to_plain(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
    raise UnsupportedState(f"{path}: a {type(value).__name__} cannot be stored without "
                           "pickle; return tensors, numbers, strings, lists or dicts")


def from_plain(value: Any) -> Any:
    """The inverse of :func:`to_plain` (tuples come back as lists)."""
    if isinstance(value, dict):
        if value.get(_TENSOR) is not True:
            return {k: from_plain(v) for k, v in value.items()}
        dtype = getattr(torch, str(value["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise CorruptSnapshot(f"cursor.loader_state: unknown tensor dtype {value['dtype']!r}",
                                  field="cursor.loader_state")
        data = bytes(value["data"])  # frombuffer refuses an empty buffer: pad, then cut
        raw = torch.frombuffer(bytearray(data or b"\0"), dtype=torch.uint8)[:len(data)]
        return raw.view(dtype).reshape(value["shape"])
    if isinstance(value, list):
        return [from_plain(v) for v in value]
    return value


def _epoch_samplers(loader: Any) -> list:
    """What has ``set_epoch``, each once: the loader (accelerate's DataLoaderShard,
    which sets its samplers' by its own count of epochs at each iter()), its sampler
    (a DistributedSampler), its batch sampler's."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    found: list = []
    for owner in (loader, getattr(loader, "sampler", None),
                  getattr(batch_sampler, "sampler", None)):
        if callable(getattr(owner, "set_epoch", None)) and not any(owner is s for s in found):
            found.append(owner)
    return found


def private_generators(loader: Any) -> list:
    """The loader's own generator and its sampler's, each once (often the same object)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    found: list = []
    owners = (loader, getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None))
    for owner in owners:
        gen = getattr(owner, "generator", None)
        if isinstance(gen, torch.Generator) and not any(gen is g for g in found):
            found.append(gen)
    return found


def _consume(it: Iterator, count: int) -> None:
    # islice into a zero-length deque drops without keeping; past the end it just stops.
    collections.deque(itertools.islice(it, count), maxlen=0)


def _persistent(loader: Any) -> bool:
    """Does iter(loader) reuse one worker iterator across epochs?"""
    return bool(getattr(loader, "persistent_workers", False) and getattr(loader, "num_workers", 0))


class _SkipSampler:
    """Stands in for a loader's index sampler during one ``iter(loader)``; its iterator
    drops ``count`` of the real sampler's indices before the first.

    ``iter()`` calls the real sampler's ``iter()`` at once, as the loader would (twice
    with workers: base iterator, then _reset; the last one is used). The drop is lazy,
    like the real sampler's first draw, so the draws keep their order (base seed, then
    shuffle seed); :meth:`skip` forces it while the epoch-start RNG is still in place.
    """

    def __init__(self, inner: Iterable, count: int) -> None:
        self.inner, self._count, self._it, self._pending = inner, count, iter(()), 0

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> "_SkipSampler":
        self._it, self._pending = iter(self.inner), self._count
        return self

    def skip(self) -> None:
        _consume(self._it, self._pending)
        self._pending = 0

    def __next__(self):
        if self._pending:
            self.skip()
        return next(self._it)


def _iter_with(loader: DataLoader, stand_in: Any) -> Iterator:
    """``iter(loader)`` drawing its indices from ``stand_in``, for this call only.

    DataLoader.__setattr__ refuses ``batch_sampler``/``sampler`` after init, hence
    object.__setattr__. Each loader iterator keeps its own ``_index_sampler`` copy, and a
    persistent one's ``_reset`` (every later epoch) reads that copy, not the loader's:
    both are swapped and both are put back.
    """
    name = "batch_sampler" if loader._auto_collation else "sampler"
    original, live, it = getattr(loader, name), loader._iterator, None
    object.__setattr__(loader, name, stand_in)
    if live is not None:
        live._index_sampler = stand_in
    try:
        it = iter(loader)
    finally:
        object.__setattr__(loader, name, original)
        for holder in (live, it):
            if getattr(holder, "_index_sampler", None) is stand_in:
                holder._index_sampler = original
    return it


class BatchStream:
    """Batches of ``loader``, epoch after epoch, with a cursor that resumes exactly.

    ``next(stream)`` crosses epoch boundaries by itself; ``for batch in stream`` yields
    the rest of the current epoch (all of it when the epoch has not begun). ``epoch`` is
    the current epoch (0-based), ``index`` the batches consumed in it.
    """

    def __init__(self, loader: Iterable, rng: RngStreams, fast_forward: str = "skip",
                 world_size: int = 1) -> None:
        if fast_forward not in FAST_FORWARD_MODES:
            raise InvalidOption(f"fast_forward={fast_forward!r}; choose one of "
                                f"{FAST_FORWARD_MODES}", field="fast_forward")
        self.loader, self.fast_forward, self._rng = loader, fast_forward, rng
        check_wrapped(loader)
        self._sampling = sampling_loader(loader)   # the DataLoader under a wrapper
        self.world_size = world_size   # the job's ranks: the cursor's global count
        self._samplers = _epoch_samplers(loader)
        self.epoch, self.index = 0, 0  # the current epoch; batches consumed in it
        self.last_fast_forward: Optional[dict] = None  # {"mode", "batches", "seconds"} of load()
        self._it: Optional[Iterator] = None   # the open epoch's iterator
        self._epoch_rng: RngState = {}        # every stream just before its iter(loader)
        self._iter_rng: RngState = {}         # persistent workers: _epoch_rng of the live
        #                                       worker iterator's birth (later epochs _reset it)
        # A wrapper's state_dict() says nothing: accelerate's shard has one either way.
        self._stateful = callable(getattr(self._sampling, "state_dict", None)) and \
            callable(getattr(self._sampling, "load_state_dict", None))
        # A private generator moves as the loader shuffles: it is an RNG stream like any other.
        for i, gen in enumerate(private_generators(loader)):
            rng.add_generator("loader" if i == 0 else f"loader.{i}", gen)

    def __len__(self) -> int:
        return len(self.loader)  # batches per epoch, as the loader counts them

    def __iter__(self) -> Iterator:
        while True:
            try:
                batch = self._pull()
            except StopIteration:
                return
            yield batch

    def __next__(self) -> Any:
        fresh = self._it is None
        try:
            return self._pull()
        except StopIteration:
            if fresh:  # a whole epoch without a batch: going on would spin forever
                raise
        return self._pull()  # the open epoch was used up: the first batch of the next

    def _pull(self) -> Any:
        if self._it is None:
            self._epoch_rng = self._rng.capture()
            self._it = self._iter_loader()
        try:
            batch = next(self._it)
        except StopIteration:
            self._it, self._epoch_rng = None, {}
            self.epoch, self.index = self.epoch + 1, 0
            raise
        self.index += 1
        return batch

    def end_epoch(self) -> None:
        """End the open epoch here, as a loop that counts its own batches does (a
        batch limit, or the epoch's last batch taken without asking for one more):
        the next batch opens the next epoch from the RNG of that moment, as a pull
        past the end would. Nothing is fetched. An epoch not begun stays as it is."""
        if self._it is None and not self.index:
            return
        self._it, self._epoch_rng = None, {}
        self.epoch, self.index = self.epoch + 1, 0

    def _iter_loader(self, stand_in: Any = None) -> Iterator:
        """``iter(loader)``; notes the birth of a persistent worker iterator, whose base
        seed came from this epoch's RNG while later epochs only _reset it. The
        samplers learn the epoch first (a DistributedSampler shuffles by it). A
        wrapper opens its base at its first next(); positioned by ``stand_in``, the
        base is opened here, under the epoch-start RNG, and handed over
        (wrapped_loaders.py)."""
        self._set_epoch()
        base = self._sampling
        if _persistent(base) and getattr(base, "_iterator", None) is None:
            self._iter_rng = self._epoch_rng   # this open gives birth to the workers
        if stand_in is None:
            return iter(self.loader)
        opened = _iter_with(base, stand_in)
        return opened if base is self.loader else opened_with(self.loader, opened)

    def _set_epoch(self) -> None:
        for sampler in self._samplers:
            sampler.set_epoch(self.epoch)

    def state(self) -> dict:
        """The cursor at this instant, in plain values msgpack carries (no tensors)."""
        live = _persistent(self._sampling) and \
            getattr(self._sampling, "_iterator", None) is not None
        # Never while no iterator exists: StatefulDataLoader.state_dict() would create one.
        stateful = self._stateful and (self._it is not None or live)
        reused = live and self._iter_rng is not self._epoch_rng
        return {"version": STATE_VERSION, "epoch": self.epoch, "index": self.index,
                "epoch_rng": dict(self._epoch_rng),
                "iter_rng": dict(self._iter_rng) if reused else {},
                "loader_state": to_plain(self.loader.state_dict()) if stateful else None,
                "world_size": self.world_size,
                "batch_size": _batch_size(self.loader)}

    def load(self, state: Mapping[str, Any], *, omit: Iterable[str] = ()) -> None:
        """Continue from ``state``: the next batch is the one the uninterrupted run
        yielded next, and later epochs match too. Every RNG stream is left as found.
        RNG streams in ``omit`` may be absent from ``state`` (restore's ``_omit``).

        A state from :func:`reshard_cursor` has no epoch-start RNG (the streams start
        fresh): its epoch opens from the RNG as it is now, ``index`` batches in."""
        epoch, index, epoch_rng, iter_rng, loader_state = self._parse(state, omit)
        resharded = bool(state.get("resharded"))
        mode = self._mode(resharded)
        self._drop_iterator()
        self.epoch, self.index, self._epoch_rng, self._iter_rng = epoch, 0, epoch_rng, iter_rng
        now, started = self._rng.capture(), time.perf_counter()
        try:
            # Mid-epoch, a stateful loader rebuilds its iterator from its own state instead.
            if iter_rng and not (self._stateful and epoch_rng):
                self._revive_workers(iter_rng, loader_state)
            if resharded and index and not epoch_rng:
                self._epoch_rng = now   # what a later snapshot's cursor restores
                self._it = self._position(mode, index, loader_state)
                self.index = index
            elif epoch_rng:
                self._rng.restore(epoch_rng)
                self._it = self._position(mode, index, loader_state)
                self.index = index
        finally:
            self._rng.restore(now)
        self.last_fast_forward = {"mode": mode, "batches": self.index,
                                  "seconds": time.perf_counter() - started}

    def _mode(self, resharded: bool = False) -> str:
        if self.fast_forward == "replay":
            return "replay"
        if self._stateful:   # a resharded cursor has no loader state for this world
            return "replay" if resharded else "loader_state"
        map_style = isinstance(self._sampling, DataLoader) and \
            not isinstance(self._sampling.dataset, IterableDataset)
        return "skip" if map_style else "replay"  # no sampler to skip with otherwise

    def _drop_iterator(self) -> None:
        """Forget any live iterator, so the next iter(loader) creates one (workers exit)."""
        self._it = None
        drop_pending(self.loader)
        if self._stateful:
            self.loader.load_state_dict({})
        elif hasattr(self._sampling, "_iterator"):
            self._sampling._iterator = None

    def _revive_workers(self, iter_rng: RngState, loader_state: Optional[dict]) -> None:
        """Persistent workers: the uninterrupted run was reusing a worker iterator born in
        an earlier epoch, and reusing one draws no base seed. Give birth to one now (from
        the RNG of the original birth, sending no index), so the next open only resets it."""
        self._rng.restore(iter_rng)
        if self._stateful:  # between epochs; its state carries the base seed (it prefetches)
            self.loader.load_state_dict(from_plain(loader_state or {}))
            iter(self._sampling)
        else:
            _iter_with(self._sampling, _SkipSampler((), 0))

    def _position(self, mode: str, index: int, loader_state: Optional[dict]) -> Iterator:
        """The open epoch's iterator, ``index`` batches in. Runs under the epoch-start RNG."""
        if mode == "loader_state":
            if loader_state is None:
                raise IncompatibleState("cursor.loader_state is missing: the snapshot's loader had "
                                        "no state_dict(); resume with that loader, or with "
                                        "fast_forward='replay'", field="cursor.loader_state")
            self.loader.load_state_dict(from_plain(loader_state))
            return self._iter_loader()
        if mode == "skip":
            stand_in = _SkipSampler(self._sampling._index_sampler, index)
            it = self._iter_loader(stand_in)
            stand_in.skip()
            return it
        it = self._iter_loader()
        _consume(it, index)  # replay: fetch and drop
        return it

    def _parse(self, state: Mapping[str, Any], omit: Iterable[str] = ()):
        check_cursor(state, self._rng, source="cursor", omit=omit)
        return (state["epoch"], state["index"], dict(state["epoch_rng"]),
                dict(state.get("iter_rng") or {}), state.get("loader_state"))


def check_cursor(state: Any, rng: RngStreams, *, source: str,
                 omit: Iterable[str] = ()) -> None:
    """Refuse, naming the field, a saved cursor :meth:`BatchStream.load` could not
    take: run before any object, stream or the cursor itself is touched. RNG streams
    in ``omit`` are not checked."""
    def bad(field: str, what: str) -> CorruptSnapshot:
        return CorruptSnapshot(f"{source}: field {field} {what}; the snapshot is damaged "
                               "or hostile, use an older one", path=source, field=field)

    if not isinstance(state, Mapping):
        raise bad("cursor", "is not a map (it needs epoch, index and epoch_rng)")
    for name in ("epoch", "index"):
        value = state.get(name)
        if type(value) is not int or value < 0:
            raise bad(f"cursor.{name}", f"is {value!r}, not a count")
    for name in ("epoch_rng", "iter_rng"):
        streams = state.get(name) if name == "epoch_rng" else state.get(name) or {}
        if not isinstance(streams, Mapping):
            raise bad(f"cursor.{name}", "is not a map of RNG streams")
        if streams:
            rng.check(streams, source=source, prefix=f"cursor.{name}", omit=omit)
    if state["index"] and not state["epoch_rng"] and not state.get("resharded"):
        raise bad("cursor.epoch_rng", "is empty although batches were consumed")
    for name in ("world_size", "batch_size"):   # absent from cursors before multi-rank jobs
        value = state.get(name)
        if value is not None and (type(value) is not int or value < 1):
            raise bad(f"cursor.{name}", f"is {value!r}, not a positive count")
    loader_state = state.get("loader_state")
    if loader_state is not None:
        try:
            from_plain(loader_state)
        except CorruptSnapshot:
            raise
        except Exception as e:  # a tensor entry torch cannot rebuild
            raise bad("cursor.loader_state", f"does not decode ({e})") from e


def _batch_size(loader: Any) -> Optional[int]:
    """The loader's batch size (samples per batch on this rank), None when it has
    none (a batch sampler, an iterable dataset batching itself, a bare iterable)."""
    size = getattr(loader, "batch_size", None)
    return size if type(size) is int and size > 0 else None


def reshard_cursor(state: Mapping[str, Any], *, new_world_size: int,
                   new_batch_size: Optional[int]) -> dict:
    """A cursor saved at one world size, for a job of ``new_world_size`` ranks each
    taking ``new_batch_size`` samples per batch: the same epoch, positioned after the
    same global count of samples, ``index * world_size * batch_size //
    (new_world_size * new_batch_size)`` batches in. RNG streams start fresh on a
    reshard: the epoch-start RNG and the loader's own state are dropped.

    Exact (no sample of the epoch seen twice or skipped) when the global batch is
    unchanged and the sampler splits one permutation per epoch across ranks
    (DistributedSampler); docs/cursor.md, "Resharding", says why and what happens
    otherwise. Raises IncompatibleState when a batch size is unknown.
    """
    check_cursor_counts(state)
    for name, value in (("new_world_size", new_world_size), ("new_batch_size", new_batch_size)):
        if value is not None and (type(value) is not int or value < 1):
            raise InvalidOption(f"reshard_cursor({name}={value!r}): a positive int",
                                field=name)
    old_world = state.get("world_size") or 1
    old_batch, where = state.get("batch_size"), "cursor.batch_size"
    if old_batch is None or new_batch_size is None:
        raise IncompatibleState(
            f"{where}: the cursor cannot be moved to {new_world_size} ranks without "
            f"the batch size (saved: {old_batch}, now: {new_batch_size}): give the "
            "DataLoader a batch_size, or resume at the saved world size "
            f"({old_world})", field=where)
    consumed = state["index"] * old_world * old_batch
    return {"version": STATE_VERSION, "epoch": state["epoch"],
            "index": consumed // (new_world_size * new_batch_size),
            "epoch_rng": {}, "iter_rng": {}, "loader_state": None,
            "world_size": new_world_size, "batch_size": new_batch_size,
            "resharded": True}


def check_cursor_counts(state: Any) -> None:
    """The counts a reshard reads: epoch and index (0 or more), world_size and
    batch_size (absent, or 1 or more)."""
    if not isinstance(state, Mapping):
        raise CorruptSnapshot("cursor: is not a map (it needs epoch and index)",
                              path="cursor", field="cursor")
    for name, least in (("epoch", 0), ("index", 0), ("world_size", 1), ("batch_size", 1)):
        value = state.get(name)
        if value is None and least:   # absent from cursors saved before multi-rank jobs
            continue
        if type(value) is not int or value < least:
            raise CorruptSnapshot(f"cursor: field cursor.{name} is {value!r}, not a "
                                  "count; the snapshot is damaged or hostile, use an "
                                  "older one", path="cursor", field=f"cursor.{name}")
