"""What a client tracks, by name: the rules behind ``Client.track()``, ``values()``,
``track_globals()`` and ``track_attrs()``.

A client keeps one dict, name -> what is captured under that name: an object with
state_dict()/load_state_dict() as it is, anything else through an adapter of
snapd_client/values.py (restored in place, or assigned back by name). Generators
are not in that dict: they join the client's RNG streams. These functions fill the
dict and refuse what could not be restored; the Client's methods are thin over them.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterable

import torch

from snapd.errors import InvalidOption
from snapd_client.restore import type_name
from snapd_client.rng import RngStreams
from snapd_client.values import Names, Values, adapt

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def check_name(name: str, caller: str) -> None:
    """Names become keys of the snapshot's objects: identifiers only."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidOption(f"{caller}: {name!r} is not an identifier; use letters, "
                            "digits and _, not starting with a digit (at most 64)",
                            field=str(name))


def _has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and \
        callable(getattr(obj, "load_state_dict", None))


def track(tracked: Dict[str, Any], rng: RngStreams, objects: Dict[str, Any]) -> None:
    """``Client.track(**objects)``: see its docstring. ``None`` values are ignored."""
    for name, obj in objects.items():
        if obj is None:
            continue
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
            track(tracked, rng, {n: value})
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
