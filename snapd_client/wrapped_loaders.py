"""Loaders that wrap a ``DataLoader``: accelerate's ``DataLoaderShard``, which
``accelerator.prepare(loader)`` returns, for the data cursor (cursor.py).

Such a loader keeps the real ``DataLoader`` as ``base_dataloader``: that one holds
the sampler and the worker iterator; the wrapper forwards attribute reads to it
(``isinstance(shard, DataLoader)`` even holds) but not writes, so the cursor swaps
samplers and drops iterators on the base (:func:`sampling_loader`). A base with
state of its own is refused (:func:`check_wrapped`).

Its iteration is a generator: ``iter(shard)`` runs nothing, and the base's iterator
is created, and the epoch's random numbers drawn (the workers' base seed, the
shuffle), at the first ``next()``. That is where a fresh epoch opens them too, so the
cursor leaves fresh epochs to it. A resume cannot wait: the epoch must be opened and
positioned while the epoch-start RNG is in place, and the first ``next()`` comes after
the caller's streams are back. So :func:`opened_with` hands the shard a base iterator
opened and positioned beforehand: the shard asks its base for one with an explicit
``self.base_dataloader.__iter__()`` (accelerate 1.16), and an instance attribute of
that name answers the call, once. Should a later accelerate ask otherwise, the first
batch says so (``UnsupportedState``) instead of resuming from another place.
"""

from __future__ import annotations

from typing import Any, Iterator

from snapd.errors import UnsupportedState

_ONCE = "__iter__"


def sampling_loader(loader: Any) -> Any:
    """The loader that draws the indices and owns the worker iterator: ``loader``'s
    ``base_dataloader`` when it wraps one, else ``loader`` itself."""
    try:
        base = vars(loader).get("base_dataloader")
    except TypeError:   # no __dict__: nothing wrapped
        return loader
    return loader if base is None else base


def check_wrapped(loader: Any) -> None:
    """Refuse a wrapper over a loader with state of its own (accelerate's
    ``use_stateful_dataloader=True``): the wrapper opens the base's iterator when it is
    built, to read its state, and uses that iterator in the first epoch; a resume
    cannot recreate it as it was, so the resumed first epoch would shuffle otherwise."""
    base = sampling_loader(loader)
    if base is not loader and callable(getattr(base, "state_dict", None)):
        raise UnsupportedState(
            f"batches(): a {type(loader).__name__} over a {type(base).__name__} "
            "(accelerate's DataLoaderConfiguration(use_stateful_dataloader=True)) cannot "
            "be resumed exactly; prepare the loader with use_stateful_dataloader=False "
            "(the default), or pass snapd the StatefulDataLoader unprepared",
            field="use_stateful_dataloader")


def opened_with(loader: Any, base_iterator: Iterator) -> Iterator:
    """``iter(loader)`` for a wrapping ``loader`` whose base's iterator is
    ``base_iterator``, opened (and positioned) by the caller."""
    base = sampling_loader(loader)
    taken = []

    def once() -> Iterator:
        _forget(base, once)
        taken.append(True)
        return base_iterator

    object.__setattr__(base, _ONCE, once)   # DataLoader.__setattr__ guards other names
    return _checked(iter(loader), type(loader).__name__, base, once, taken)


def drop_pending(loader: Any) -> None:
    """Forget a base iterator handed over by :func:`opened_with` and not yet taken."""
    base = sampling_loader(loader)
    if base is not loader:
        vars(base).pop(_ONCE, None)


def _forget(base: Any, once: Any) -> None:
    if vars(base).get(_ONCE) is once:   # not a later hand-over's
        del vars(base)[_ONCE]


def _checked(outer: Iterator, wrapper: str, base: Any, once: Any, taken: list) -> Iterator:
    try:
        for batch in outer:
            if not taken:
                raise UnsupportedState(
                    f"batches(): the {wrapper} wrapping a {type(base).__name__} did "
                    "not take the positioned iterator, so the resumed epoch would "
                    "start over; resume with batches(loader, fast_forward='replay')",
                    field="fast_forward")
            yield batch
    finally:
        _forget(base, once)
