"""A module's weights read from a snapshot, keyed as its ``state_dict()``: what
``snapd export`` writes and the output check (snapd/outputcheck.py) loads.

Which object is the module is decided from the manifest without executing anything
it names: a ``type`` under ``torch`` is looked up in torch itself
(``torch.nn.modules.container.Sequential`` is a Module, ``torch.optim.adamw.AdamW``
is not); a type from user code (``__main__.GPT``) is never imported, and counts as
a module when its state carries the ``_metadata`` only a module's ``state_dict()``
has. A module saved wrapped in DistributedDataParallel (its ``type`` ends with
``DistributedDataParallel``) loses the wrapper's ``module.`` key prefix, so it loads
into the bare model.

``only_trainable``: the tensors whose manifest entry lacks ``"frozen": true``
(docs/format.md): a fine-tuned adapter or head, without its base.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from snapd.skeleton import unflatten

DDP_TYPE_SUFFIX = "DistributedDataParallel"
DDP_PREFIX = "module."


def _torch_class(type_name: str) -> Optional[type]:
    """The class a ``module.QualName`` string names, looked up only inside torch."""
    parts = type_name.split(".")
    if parts[0] != "torch":
        return None
    for cut in range(len(parts) - 1, 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            value = getattr(value, attr, None)
        return value if isinstance(value, type) else None
    return None


def is_module(entry: Dict[str, Any]) -> bool:
    cls = _torch_class(str(entry.get("type")))
    if cls is not None:
        return issubclass(cls, torch.nn.Module)
    return entry.get("metadata") is not None


def modules(reader: Any) -> List[str]:
    """The names of the snapshot's objects that are modules."""
    return [n for n, o in reader.objects.items() if is_module(o)]


def is_ddp(entry: Dict[str, Any]) -> bool:
    """Saved from a DistributedDataParallel wrapper: its keys carry ``module.``."""
    return str(entry.get("type") or "").endswith(DDP_TYPE_SUFFIX)


def _key(entry: Dict[str, Any], path: str) -> str:
    """A manifest tensor path (``.module.0.weight``) as the bare model's key."""
    key = path[1:] if path.startswith(".") else path
    return key[len(DDP_PREFIX):] if is_ddp(entry) and key.startswith(DDP_PREFIX) else key


def state_of(reader: Any, name: str) -> Any:
    """An object's state tree, whole tensors; a DDP wrapper's keys without
    ``module.``, so that the bare model's load_state_dict takes it."""
    entry = reader.objects[name]
    tree = unflatten(entry["skeleton"], reader.load_object(name),
                     source=os.path.join(reader.path, entry.get("file") or "manifest.snapd"))
    if is_ddp(entry) and isinstance(tree, dict):
        items = [(k[len(DDP_PREFIX):] if isinstance(k, str) and k.startswith(DDP_PREFIX)
                  else k, v) for k, v in tree.items()]
        tree = type(tree)(items)   # an OrderedDict stays one
    return tree


def state_leaves(tree: Any, prefix: str = "") -> List[tuple]:
    """(path, leaf) of a state tree, paths spelt as the manifest spells tensor paths:
    ``.key`` for a mapping entry, ``[i]`` for a list or tuple item."""
    if isinstance(tree, dict):
        return [leaf for k, v in tree.items() for leaf in state_leaves(v, f"{prefix}.{k}")]
    if isinstance(tree, (list, tuple)):
        return [leaf for i, v in enumerate(tree) for leaf in state_leaves(v, f"{prefix}[{i}]")]
    return [(prefix, tree)]


def trainable_keys(reader: Any, name: str) -> set:
    """The state-dict keys of ``name``'s tensors not marked frozen in the manifest."""
    entry = reader.objects[name]
    return {_key(entry, t["path"]) for t in entry["tensors"] if t.get("frozen") is not True}


def weights(reader: Any, name: str, only_trainable: bool = False
            ) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """The object's tensors keyed by state_dict key (``only_trainable``: those not
    marked frozen), and the plain leaves skipped."""
    keep = trainable_keys(reader, name) if only_trainable else None
    out, skipped = {}, []
    for path, leaf in state_leaves(state_of(reader, name)):
        key = path[1:] if path.startswith(".") else path
        if not isinstance(leaf, torch.Tensor):
            skipped.append(key)
        elif keep is None or key in keep:
            out[key] = leaf.contiguous()
    return out, skipped
