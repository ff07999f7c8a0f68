"""``snapd export SNAPSHOT -o OUT``: a model's weights, or a DCP checkpoint, for other tools.

``--format safetensors`` (the default): only the tracked nn.Module's state goes out:
no optimizer state, no RNG, no cursor, no path of the training machine. Which object
is the module is decided from the manifest without executing anything it names: a ``type`` under ``torch`` is looked up
in torch itself (``torch.nn.modules.container.Sequential`` is a Module,
``torch.optim.adamw.AdamW`` is not); a type from user code (``__main__.GPT``) is
never imported, and counts as a module when its state carries the ``_metadata`` only a
module's ``state_dict()`` has. Only the chosen object's tensor file is read (and
verified, chunk by chunk).

safetensors metadata (all strings; absent values are ""): ``format`` ("pt"),
``snapd.run``, ``snapd.step``, ``snapd.snapshot`` (the snapshot's name),
``snapd.object``, ``snapd.data_version``, ``snapd.base_revision`` (the lineage
parent, ``run/snapshot``, of a warm-started lineage).

``--format dcp``: a directory that ``torch.distributed.checkpoint.load(state_dict,
checkpoint_id=OUT)`` reads, holding every tracked object's state (or ``--object``'s)
keyed by its name, as in ``{"model": model.state_dict(), "optim": opt.state_dict()}``.

A multi-rank snapshot exports whole tensors (shards assembled, replicated tensors
read from the rank that stored them). A module saved wrapped in
DistributedDataParallel (its ``type`` ends with ``DistributedDataParallel``) is
exported without the wrapper's ``module.`` key prefix, so it loads into the bare model.
"""

from __future__ import annotations

import importlib
import os
import secrets
import shutil
import warnings
from typing import Any, Dict, List, Optional, Tuple

import click
import torch

from snapd.commands.common import (ROOT_HELP, Snapshot as SnapshotReader, fail, open_reader,
                                   optional_import, state_leaves)
from snapd.commands import remote
from snapd.commands.locate import Located
from snapd.errors import CorruptSnapshot
from snapd.skeleton import unflatten
from snapd.text import count, human_bytes

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


def choose_object(reader: SnapshotReader, wanted: Optional[str]) -> str:
    objects = reader.objects
    listing = ", ".join(f"{n} ({o.get('type')})" for n, o in objects.items()) or "none"
    if wanted is not None:
        if wanted not in objects:
            fail(f"{reader.path}: no object {wanted!r}; it holds {listing}", 2)
        if not is_module(objects[wanted]):
            fail(f"{reader.path}: objects.{wanted}.type is {objects[wanted].get('type')}, "
                 "not a torch.nn.Module; export writes model weights only (no optimizer "
                 f"state). Modules here: {', '.join(_modules(reader)) or 'none'}", 2)
        return wanted
    modules = _modules(reader)
    if not modules:
        fail(f"{reader.path}: no tracked object is a torch.nn.Module (objects: {listing}); "
             "export writes model weights only", 1)
    if len(modules) > 1:
        fail(f"{reader.path}: several objects are modules ({', '.join(modules)}); choose "
             "one with --object NAME", 2)
    return modules[0]


def _modules(reader: SnapshotReader) -> List[str]:
    return [n for n, o in reader.objects.items() if is_module(o)]


def is_ddp(entry: Dict[str, Any]) -> bool:
    """Saved from a DistributedDataParallel wrapper: its keys carry ``module.``."""
    return str(entry.get("type") or "").endswith(DDP_TYPE_SUFFIX)


def state_of(reader: SnapshotReader, name: str) -> Any:
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


def weights(reader: SnapshotReader, name: str) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """The object's tensors keyed by state_dict key, and the plain leaves skipped."""
    tree = state_of(reader, name)
    out, skipped = {}, []
    for path, leaf in state_leaves(tree):
        key = path[1:] if path.startswith(".") else path
        if isinstance(leaf, torch.Tensor):
            out[key] = leaf.contiguous()
        else:
            skipped.append(key)
    return out, skipped


def metadata(reader: SnapshotReader, name: str, snapshot_name: str) -> Dict[str, str]:
    m = reader.manifest
    parent = (m.get("lineage") or {}).get("parent")
    version = m.get("data_version")
    return {"format": "pt", "snapd.run": str(m.get("run") or ""),
            "snapd.step": str(m["step"]), "snapd.snapshot": snapshot_name,
            "snapd.object": name, "snapd.data_version": "" if version is None else str(version),
            "snapd.base_revision": f"{parent.get('run')}/{parent.get('snapshot')}"
                                   if parent else ""}


def _read(loc: Located, read: Any) -> Any:
    """``read()``, or exit naming the damage and what to do."""
    try:
        return read()
    except CorruptSnapshot as e:
        fail(f"{e}\n  hint: snapd verify {loc.path}; export an older snapshot (snapd ls)", 1)


def _fresh_output(output: str) -> str:
    output = os.path.abspath(output)
    if not os.path.isdir(os.path.dirname(output)):
        fail(f"{os.path.dirname(output)}: no such directory for -o {output}", 2)
    return output


def export_safetensors(loc: Located, reader: SnapshotReader, wanted: Optional[str],
                       output: str, save_file: Any) -> None:
    name = choose_object(reader, wanted)
    tensors, skipped = _read(loc, lambda: weights(reader, name))
    if not tensors:
        fail(f"{reader.path}: objects.{name} holds no tensor; nothing to export", 1)
    output = _fresh_output(output)
    if os.path.isdir(output):
        fail(f"{output}: a directory; -o names the file to write (--format dcp writes "
             "a directory)", 2)
    tmp = f"{output}.tmp-{secrets.token_hex(4)}"
    try:
        save_file(tensors, tmp, metadata=metadata(reader, name, loc.name))  # write aside
        os.replace(tmp, output)  # then publish whole: a reader never sees half a file
    except Exception as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        fail(f"{output}: safetensors could not write objects.{name}: {e}", 1)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    click.echo(f"wrote {output}: {count(len(tensors), 'tensor')} of {name} ({human_bytes(total)}) "
               f"from {loc.label}, step {reader.step}")
    if skipped:
        click.echo(f"skipped {len(skipped)} non-tensor value(s): {', '.join(skipped[:5])}"
                   + (" ..." if len(skipped) > 5 else ""))


def export_dcp(loc: Located, reader: SnapshotReader, wanted: Optional[str],
               output: str) -> None:
    """Every object's state (or ``wanted``'s) as a torch.distributed.checkpoint
    directory, written aside and renamed into place: no half checkpoint is ever seen."""
    from torch.distributed import checkpoint as dcp
    if wanted is not None and wanted not in reader.objects:
        fail(f"{reader.path}: no object {wanted!r}; it holds "
             f"{', '.join(reader.objects) or 'none'}", 2)
    names = [wanted] if wanted else list(reader.objects)
    state = _read(loc, lambda: {name: state_of(reader, name) for name in names})
    output = _fresh_output(output)
    if os.path.lexists(output):
        fail(f"{output}: exists; a DCP checkpoint is a directory and is not replaced in "
             "place. Remove it or choose another -o", 2)
    tmp = f"{output}.tmp-{secrets.token_hex(4)}"
    try:
        with warnings.catch_warnings():   # "assuming the intent is to save in a single
            warnings.simplefilter("ignore")   # process": that is the intent
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
        os.rename(tmp, output)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        fail(f"{output}: torch.distributed.checkpoint could not write "
             f"{', '.join(names)}: {e}", 1)
    tensors = [leaf for name in names for _, leaf in state_leaves(state[name])
               if isinstance(leaf, torch.Tensor)]
    total = sum(t.numel() * t.element_size() for t in tensors)
    click.echo(f"wrote {output} (DCP): {', '.join(names)}, {count(len(tensors), 'tensor')} "
               f"({human_bytes(total)}) from {loc.label}, step {reader.step}")


@click.command()
@click.argument("snapshot")
@click.option("--format", "fmt", type=click.Choice(["safetensors", "dcp"]),
              default="safetensors", show_default=True,
              help="safetensors: one module's weights in a file. dcp: every object's "
                   "state in a torch.distributed.checkpoint directory.")
@click.option("-o", "--output", required=True, type=click.Path(),
              help="The file (safetensors: replaced atomically if it exists) or the new "
                   "directory (dcp) to write.")
@click.option("--object", "wanted", help="The object to export (safetensors: the module, "
                                         "when several are tracked).")
@click.option("--root", help=ROOT_HELP)
def export(snapshot: str, fmt: str, output: str, wanted: Optional[str],
           root: Optional[str]) -> None:
    """Write the model weights of SNAPSHOT (the tracked nn.Module's state only: no
    optimizer state, no data paths) to a safetensors file, with run, step, snapshot,
    data_version and base revision in its metadata. Non-tensor leaves are skipped.
    With --format dcp, write every tracked object's state (model, optimizer, ...)
    keyed by object name to a directory torch.distributed.checkpoint.load reads.

    A multi-rank snapshot is exported whole; a DistributedDataParallel-wrapped
    model's keys lose their "module." prefix, so they load into the bare model.

    SNAPSHOT is a snapshot directory, RUN/NAME (gpt/00001200 or gpt/1200), RUN or
    RUN@latest (its LATEST), or RUN@best, relative to --root; or URL/RUN@STEP on a
    remote root (pulled into a temporary directory, every checksum checked).

    Example: snapd export gpt-small@best -o gpt-small.safetensors --root checkpoints
    """
    save_file = None if fmt == "dcp" else \
        optional_import("safetensors.torch", "export", "export").save_file
    with remote.located(snapshot, root) as loc:   # a remote one pulled, then removed
        reader = open_reader(loc.path, objects=[wanted] if wanted else [])  # files on read
        if fmt == "dcp":
            export_dcp(loc, reader, wanted, output)
        else:
            export_safetensors(loc, reader, wanted, output, save_file)
