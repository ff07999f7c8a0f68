"""What a client tracks, by name: the rules behind ``Client.track()``, ``values()``,
``track_globals()`` and ``track_attrs()``, and the adapters for loop values, tensors
and globals, state that lives outside any ``state_dict()``.

A client keeps one dict, name -> what is captured under that name: an object with
state_dict()/load_state_dict() as it is, anything else through an adapter below
(restored in place, or assigned back by name). Generators are not in that dict: they
join the client's RNG streams. :func:`track_objects`, :func:`values_home` and
:func:`track_names` fill the dict and refuse what could not be restored; the
Client's methods are thin over them.

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

import re
from typing import Any, Dict, Iterable, List, Tuple

import torch

from snapd.errors import IncompatibleState, InvalidOption, UnsupportedState
from snapd_client.rng import RngStreams

_PLAIN = (type(None), bool, int, float, str, bytes)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


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
    raise UnsupportedState(
        f"track({name}=...): a {type_name(obj)} has no "
        "state_dict()/load_state_dict(); give it both, or track the plain values it "
        "holds with ckpt.values(...) or ckpt.track_attrs(obj, ...)", field=name)


def type_name(obj: Any) -> str:
    """The type a snapshot records an object under, and restore checks it against."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


# --- the tracked dict: what each name is captured as, and which names are refused ---

def check_name(name: str, caller: str) -> None:
    """Names become keys of the snapshot's objects: identifiers only."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidOption(f"{caller}: {name!r} is not an identifier; use letters, "
                            "digits and _, not starting with a digit (at most 64)",
                            field=str(name))


def _has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and \
        callable(getattr(obj, "load_state_dict", None))


def inner_optimizer(obj: Any) -> Any:
    """The optimizer an optimizer wrapper delegates to, else ``obj``: a wrapper whose
    ``state`` and ``param_groups`` are those of its ``.optimizer`` (accelerate's
    ``AcceleratedOptimizer``) keeps nothing of its own, and never runs the step hooks
    registered on it (it skips ``Optimizer.__init__``); the inner one's run on every
    real update. A wrapper with state of its own is tracked as it is."""
    inner = getattr(obj, "optimizer", None)
    if isinstance(obj, torch.optim.Optimizer) and isinstance(inner, torch.optim.Optimizer) \
            and obj.state is inner.state and obj.param_groups is inner.param_groups:
        return inner
    return obj


def track_objects(tracked: Dict[str, Any], rng: RngStreams,
                  objects: Dict[str, Any]) -> None:
    """``Client.track(**objects)``: see its docstring. ``None`` values are ignored;
    an optimizer wrapper is tracked as the optimizer inside (:func:`inner_optimizer`)."""
    for name, obj in objects.items():
        if obj is None:
            continue
        obj = inner_optimizer(obj)
        if not _NAME.match(name):
            raise InvalidOption(f"track({name}=...): names must be identifiers",
                                field=name)
        if isinstance(obj, torch.Generator):
            rng.add_generator(name, obj)
        elif _has_state(obj):
            tracked[name] = obj
        else:
            tracked[name] = adapt(name, obj)


def values_home(tracked: Dict[str, Any], name: str, initial: Dict[str, Any]) -> Values:
    """``Client.values()``: the Values tracked under ``name``, created at first use; a
    second call adds its new keys to the same object."""
    home = tracked.get(name)
    if home is None:
        check_name(name, "values")
        home = tracked[name] = Values()
    elif not isinstance(home, Values):
        raise InvalidOption(f"values(name={name!r}): {name!r} already tracks a "
                            f"{type_name(home)}; choose another name", field=name)
    home.set_defaults(initial)
    return home


def track_names(tracked: Dict[str, Any], rng: RngStreams, namespace: Dict[str, Any],
                names: Iterable[str], home_name: str, caller: str) -> None:
    """``track_globals()``/``track_attrs()``: each name tracked as what it holds now,
    an object with state by itself, anything else read from ``namespace`` at each
    snapshot under ``home_name``."""
    plain = []
    for n in names:
        check_name(n, caller)
        value = namespace.get(n)
        if isinstance(value, torch.Generator) or _has_state(value):
            track_objects(tracked, rng, {n: value})
        else:
            plain.append(n)
    home = tracked.get(home_name)
    if home is None:
        check_name(home_name, caller)
        tracked[home_name] = Names(namespace, plain)
    elif type(home) is Names and home.namespace is namespace:
        home.add(plain)
    else:
        raise InvalidOption(f"{caller}(name={home_name!r}): {home_name!r} already "
                            "tracks something else; pass another name=", field=home_name)
