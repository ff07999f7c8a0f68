"""Loop values, tensors and globals: state that lives outside any ``state_dict()``.

A training script keeps state no object owns: a prefetched batch, ``best_val_loss``,
an annealed ``lr``, a recurrent ``hidden`` carried across batches. snapd tracks
objects through ``state_dict()``/``load_state_dict()``, so each kind of loose state
gets an adapter here that has both, and the rest of the client (capture, the fit
check, restore's all-or-nothing apply) sees one more tracked object:

- :class:`TrackedTensor`, ``track(mask=tensor)``: restored *in place* (``copy_``), so
  every reference the script holds stays valid; its shape and dtype must fit.
- :class:`TrackedContainer`, ``track(history=[...])``: a list or dict of plain values,
  restored in place (the same list or dict object, its contents replaced).
- :class:`Names`, ``track_globals("X", "lr")`` and ``track_attrs(trainer, ...)``: names
  in a namespace (a module's globals, an object's ``__dict__``), read at each snapshot
  and assigned back at restore. A number cannot be updated in place, so its *name* is
  what is tracked.
- :class:`Values`, ``loop = ckpt.values(best_val_loss=1e9)``: a namespace of its own,
  with attribute access.

A home (:class:`Names`, :class:`Values`, :class:`TrackedContainer`) holds values that
may not exist yet and may change shape (``hidden`` is None until the first batch), so
restore checks only its type against the snapshot, never its contents; it is loaded
last (see docs/operations.md, "What restore checks, and when").

A home's state is ``{"values": {name: value}, "absent": [name]}``: ``absent`` lists
the tracked names that had no value at snapshot time. Restore assigns every saved
value (a name the snapshot has and the home does not yet track becomes tracked: the
script may have added it after this point), removes the absent names, and leaves a
tracked name the snapshot does not mention (new in the code since) as it is. A tensor
restored into a name that holds a tensor now lands on that tensor's device; one
restored into a name that holds none stays on the CPU.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Tuple

import torch

from snapd.errors import IncompatibleState, UnsupportedState

_PLAIN = (type(None), bool, int, float, str, bytes)


class ValueHome:
    """Holds plain values: restore checks its type only, and loads it last."""


class TrackedTensor:
    """One tensor, tracked by reference and restored into the same storage."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def state_dict(self) -> Dict[str, Any]:
        return {"tensor": self.tensor}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        saved = state["tensor"]
        if saved.shape != self.tensor.shape or saved.dtype != self.tensor.dtype:
            raise IncompatibleState(f"tensor is {saved.dtype}{list(saved.shape)} in the "
                                    f"snapshot but {self.tensor.dtype}"
                                    f"{list(self.tensor.shape)} now", field="tensor")
        with torch.no_grad():  # a leaf that requires grad may not be written otherwise
            self.tensor.copy_(saved)


class TrackedContainer(ValueHome):
    """A list or dict of plain values (tensors inside too), restored in place."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> Dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        saved = like(state["value"], self.value)
        if isinstance(self.value, list):
            self.value[:] = saved
        else:
            self.value.clear()
            self.value.update(saved)


class Names(ValueHome):
    """Names in a namespace dict (module globals, an object's ``__dict__``)."""

    def __init__(self, namespace: Dict[str, Any], names: Iterable[str] = ()) -> None:
        self._namespace = namespace
        self._names: List[str] = []
        self.add(names)

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(self._names)

    @property
    def namespace(self) -> Dict[str, Any]:
        return self._namespace

    def add(self, names: Iterable[str]) -> None:
        self._names.extend(n for n in names if n not in self._names)

    def state_dict(self) -> Dict[str, Any]:
        ns = self._namespace
        return {"values": {n: ns[n] for n in self._names if n in ns},
                "absent": [n for n in self._names if n not in ns]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        saved, absent = state.get("values") or {}, state.get("absent") or []
        self.add(list(saved) + list(absent))
        for name, value in saved.items():
            self._namespace[name] = like(value, self._namespace.get(name))
        for name in absent:
            self._namespace.pop(name, None)


class Values(Names):
    """Loop values with attribute access: ``loop.lr /= 4``. Every attribute assigned
    is tracked, including ones first set after ``values()``."""

    def __init__(self, **initial: Any) -> None:
        store: Dict[str, Any] = {}
        for attr, value in (("_store", store), ("_namespace", store), ("_names", [])):
            object.__setattr__(self, attr, value)  # past __setattr__: not loop values
        self.set_defaults(initial)

    def set_defaults(self, initial: Dict[str, Any]) -> None:
        """Add the names not tracked yet, with these values; keep the others."""
        for name, value in initial.items():
            if name not in self._store:
                setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._store[name]
        except KeyError:
            raise AttributeError(f"no loop value {name!r}; have {sorted(self._store)}") \
                from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or hasattr(type(self), name):
            raise AttributeError(f"loop value {name!r}: the name is reserved (it starts "
                                 "with _ or is a method of Values); choose another")
        self._store[name] = value
        self.add([name])

    def __delattr__(self, name: str) -> None:
        self._store.pop(name, None)  # stays tracked: recorded absent

    def __repr__(self) -> str:
        return "Values(" + ", ".join(f"{k}={v!r}" for k, v in self._store.items()) + ")"


def like(saved: Any, current: Any) -> Any:
    """``saved`` with each tensor moved to the device of the tensor at the same place
    in ``current`` (restore reads tensors onto the CPU)."""
    if isinstance(saved, torch.Tensor):
        if isinstance(current, torch.Tensor) and current.device != saved.device:
            return saved.to(current.device)
        return saved
    if isinstance(saved, (list, tuple)) and isinstance(current, (list, tuple)) \
            and len(saved) == len(current):
        items = [like(s, c) for s, c in zip(saved, current)]
        return items if isinstance(saved, list) else tuple(items)
    if isinstance(saved, dict) and isinstance(current, dict):
        return {k: like(v, current.get(k)) for k, v in saved.items()}
    return saved


def adapt(name: str, obj: Any) -> Any:
    """What ``track(name=obj)`` tracks for an object without state_dict(): a tensor or
    a list/dict (restored in place); a number or string cannot be, so it is refused
    with the two homes that can hold it."""
    if isinstance(obj, torch.Tensor):
        return TrackedTensor(obj)
    if isinstance(obj, (list, dict)):
        return TrackedContainer(obj)
    if isinstance(obj, _PLAIN) or isinstance(obj, tuple):
        raise UnsupportedState(
            f"track({name}=...): a {type(obj).__name__} cannot be restored in place "
            f"(the script's variable would keep its old value). Keep it in "
            f"`loop = ckpt.values({name}=...)` and use loop.{name}, or, for a module-level "
            f"variable, ckpt.track_globals({name!r})", field=name)
    cls = type(obj)
    raise UnsupportedState(
        f"track({name}=...): a {cls.__module__}.{cls.__qualname__} has no "
        "state_dict()/load_state_dict(); give it both, or track the plain values it "
        "holds with ckpt.values(...) or ckpt.track_attrs(obj, ...)", field=name)
