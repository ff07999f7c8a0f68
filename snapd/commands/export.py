"""``snapd export SNAPSHOT -o OUT``: a model's weights, or a DCP checkpoint, for other tools.

``--format safetensors`` (the default): only the tracked nn.Module's state goes out:
no optimizer state, no RNG, no cursor, no path of the training machine. Which object
is the module is decided from the manifest without executing anything it names
(snapd/weights.py). Only the chosen object's tensor file is read (and verified,
chunk by chunk). ``--only-trainable``: only its tensors whose manifest entry lacks
``"frozen": true`` (a fine-tuned adapter or head, without the base it was trained
over); the base model's reference in the metadata says which base to load first.

safetensors metadata (all strings; absent values are ""): ``format`` ("pt"),
``snapd.run``, ``snapd.step``, ``snapd.snapshot`` (the snapshot's name),
``snapd.object``, ``snapd.data_version``, ``snapd.parent`` (the lineage parent,
``run/snapshot``, of a warm-started lineage), ``snapd.base_name``,
``snapd.base_revision``, ``snapd.base_digest`` (the manifest's ``base``),
``snapd.only_trainable`` ("true" or "false").

No exported metadata names a place on the training machine: the values are names
the manifest holds (run, snapshot, object), never the root, a directory, a data file
or the host; a free-text value (the data version, the base's name or revision) that
looks like a local path or names the host is left out, and the command says so
(:func:`local_values`).

``--format dcp``: a directory that ``torch.distributed.checkpoint.load(state_dict,
checkpoint_id=OUT)`` reads, holding every tracked object's state (or ``--object``'s)
keyed by its name, as in ``{"model": model.state_dict(), "optim": opt.state_dict()}``.

A multi-rank snapshot exports whole tensors (shards assembled, replicated tensors
read from the rank that stored them). A module saved wrapped in
DistributedDataParallel (its ``type`` ends with ``DistributedDataParallel``) is
exported without the wrapper's ``module.`` key prefix, so it loads into the bare model.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import warnings
from typing import Any, Dict, List, Optional

import click
import torch

from snapd.commands.common import (ROOT_HELP, Snapshot as SnapshotReader, fail, open_reader,
                                   optional_import)
from snapd.commands.locate import files_of, resolve
from snapd.errors import CorruptSnapshot
from snapd.roots import Snap
from snapd.humanize import count, human_bytes
from snapd.weights import is_module, modules, state_leaves, state_of, weights

# Free-text values the user chose: left out when they look like a local path.
FREE_TEXT = ("snapd.data_version", "snapd.base_name", "snapd.base_revision")
_ABSOLUTE = re.compile(r"^(?:[/\\~]|\.{1,2}[/\\]|[A-Za-z]:[/\\])|^file:", re.IGNORECASE)


def choose_object(reader: SnapshotReader, wanted: Optional[str]) -> str:
    objects = reader.objects
    listing = ", ".join(f"{n} ({o.get('type')})" for n, o in objects.items()) or "none"
    if wanted is not None:
        if wanted not in objects:
            fail(f"{reader.path}: no object {wanted!r}; it holds {listing}", 2)
        if not is_module(objects[wanted]):
            fail(f"{reader.path}: objects.{wanted}.type is {objects[wanted].get('type')}, "
                 "not a torch.nn.Module; export writes model weights only (no optimizer "
                 f"state). Modules here: {', '.join(modules(reader)) or 'none'}", 2)
        return wanted
    found = modules(reader)
    if not found:
        fail(f"{reader.path}: no tracked object is a torch.nn.Module (objects: {listing}); "
             "export writes model weights only", 1)
    if len(found) > 1:
        fail(f"{reader.path}: several objects are modules ({', '.join(found)}); choose "
             "one with --object NAME", 2)
    return found[0]


def metadata(reader: SnapshotReader, name: str, snapshot_name: str,
             only_trainable: bool = False) -> Dict[str, str]:
    m = reader.manifest
    parent = (m.get("lineage") or {}).get("parent")
    version = m.get("data_version")
    base = m.get("base") or {}
    return {"format": "pt", "snapd.run": str(m.get("run") or ""),
            "snapd.step": str(m["step"]), "snapd.snapshot": snapshot_name,
            "snapd.object": name, "snapd.data_version": "" if version is None else str(version),
            "snapd.parent": f"{parent.get('run')}/{parent.get('snapshot')}"
                            if parent else "",
            "snapd.base_name": str(base.get("name") or ""),
            "snapd.base_revision": str(base.get("revision") or ""),
            "snapd.base_digest": str(base.get("digest") or ""),
            "snapd.only_trainable": "true" if only_trainable else "false"}


def local_values(meta: Dict[str, str], places: List[str]) -> List[str]:
    """The free-text keys whose value looks like a place on this machine: an absolute
    or ``./`` path, a ``file:`` URL, or one of ``places`` (the root, the snapshot's
    directory, the host name) inside it."""
    found = []
    for key in FREE_TEXT:
        value = meta.get(key) or ""
        if _ABSOLUTE.search(value) or any(p and p.lower() in value.lower() for p in places):
            found.append(key)
    return found


def _places(reader: SnapshotReader) -> List[str]:
    snapshot_dir = os.path.abspath(reader.path)
    root = os.path.dirname(os.path.dirname(os.path.dirname(snapshot_dir)))
    host = socket.gethostname()
    return [p for p in (snapshot_dir, root if root != os.sep else "",
                        host if len(host) >= 3 else "") if p]


def clean_metadata(reader: SnapshotReader, meta: Dict[str, str]) -> Dict[str, str]:
    """``meta`` without a local place in it (module docstring), each key left out said."""
    for key in local_values(meta, _places(reader)):
        click.echo(f"left out of the metadata: {key} ({meta[key]!r} looks like a place "
                   "on this machine; exported metadata never names one)")
        meta[key] = ""
    return meta


def _read(loc: Snap, read: Any) -> Any:
    """``read()``, or exit naming the damage and what to do."""
    try:
        return read()
    except CorruptSnapshot as e:
        fail(f"{e}\n  hint: snapd verify {loc.argument}; export an older snapshot (snapd ls)", 1)


def _fresh_output(output: str) -> str:
    output = os.path.abspath(output)
    if not os.path.isdir(os.path.dirname(output)):
        fail(f"{os.path.dirname(output)}: no such directory for -o {output}", 2)
    return output


def export_safetensors(loc: Snap, reader: SnapshotReader, wanted: Optional[str],
                       output: str, save_file: Any, only_trainable: bool = False) -> None:
    name = choose_object(reader, wanted)
    tensors, skipped = _read(loc, lambda: weights(reader, name, only_trainable))
    if not tensors:
        fail(f"{reader.path}: objects.{name} holds no "
             f"{'trainable ' if only_trainable else ''}tensor; nothing to export", 1)
    output = _fresh_output(output)
    if os.path.isdir(output):
        fail(f"{output}: a directory; -o names the file to write (--format dcp writes "
             "a directory)", 2)
    meta = clean_metadata(reader, metadata(reader, name, loc.name, only_trainable))
    tmp = f"{output}.tmp-{secrets.token_hex(4)}"
    try:
        save_file(tensors, tmp, metadata=meta)  # write aside
        os.replace(tmp, output)  # then publish whole: a reader never sees half a file
    except Exception as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        fail(f"{output}: safetensors could not write objects.{name}: {e}", 1)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    what = "trainable tensor" if only_trainable else "tensor"
    click.echo(f"wrote {output}: {count(len(tensors), what)} of {name} ({human_bytes(total)}) "
               f"from {loc.label}, step {reader.step}")
    if only_trainable:
        _say_base(reader.manifest, reader.objects[name], len(tensors))
    if skipped:
        click.echo(f"skipped {len(skipped)} non-tensor value(s): {', '.join(skipped[:5])}"
                   + (" ..." if len(skipped) > 5 else ""))


def _say_base(manifest: Dict[str, Any], entry: Dict[str, Any], kept: int) -> None:
    """What an only-trainable export needs beside it: the base, named or not."""
    frozen = sum(1 for t in entry["tensors"] if t.get("frozen") is True)
    base = manifest.get("base")
    if base:
        click.echo(f"base: {base['name']}@{base['revision']} (digest {base['digest']}); "
                   f"{count(frozen, 'frozen tensor')} left out: load that base, then "
                   "load_state_dict(this, strict=False)")
    else:
        click.echo(f"base: none recorded (the run gave no track(..., base=...)): the "
                   f"metadata cannot say which base these {kept} tensors go over; "
                   f"{count(frozen, 'frozen tensor')} left out")
    if not frozen:
        click.echo("no tensor is marked frozen in this snapshot (written before snapd "
                   "recorded frozen tensors, or nothing was frozen): every tensor was "
                   "written")


def export_dcp(loc: Snap, reader: SnapshotReader, wanted: Optional[str],
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
            dcp.save(state, storage_writer=_writer_without_path(dcp, tmp), no_dist=True)
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


def _writer_without_path(dcp: Any, directory: str) -> Any:
    """DCP's file writer, except that the ``.metadata`` it writes does not record the
    directory it was written to (``StorageMeta.checkpoint_id``, by default the path of
    the checkpoint on this machine); loading never needs it."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Writer(dcp.FileSystemWriter):
        def storage_meta(self) -> Any:
            return StorageMeta(save_id=self.save_id)

    return Writer(directory)


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
@click.option("--only-trainable", is_flag=True,
              help="safetensors: only the tensors not marked frozen (a fine-tuned "
                   "adapter or head), with the base model's name, revision and digest in "
                   "the metadata.")
@click.option("--root", help=ROOT_HELP)
def export(snapshot: str, fmt: str, output: str, wanted: Optional[str],
           only_trainable: bool, root: Optional[str]) -> None:
    """Write the model weights of SNAPSHOT (the tracked nn.Module's state only: no
    optimizer state, no data paths) to a safetensors file, with run, step, snapshot,
    data_version, lineage parent and base model in its metadata, and no path, directory
    or host name. Non-tensor leaves are skipped. --only-trainable: only the tensors
    not marked frozen (an adapter, a head); load the base the metadata names, then
    load_state_dict(load_file(OUT), strict=False).
    With --format dcp, write every tracked object's state (model, optimizer, ...)
    keyed by object name to a directory torch.distributed.checkpoint.load reads.

    A multi-rank snapshot is exported whole; a DistributedDataParallel-wrapped
    model's keys lose their "module." prefix, so they load into the bare model.

    SNAPSHOT is a snapshot directory, RUN/NAME (gpt/00001200 or gpt/1200), RUN or
    RUN@latest (its LATEST), or RUN@best, relative to --root; or URL/RUN@STEP on a
    root behind a URL (pulled into a temporary directory, every checksum checked).

    Example: snapd export gpt-small@best -o gpt-small.safetensors --root checkpoints
    """
    if only_trainable and fmt == "dcp":
        fail("--only-trainable writes safetensors; drop --format dcp", 2)
    save_file = None if fmt == "dcp" else \
        optional_import("safetensors.torch", "export", "export").save_file
    found, loc = resolve(snapshot, root)
    with files_of(found, loc) as path:   # behind a URL: pulled, then removed
        reader = open_reader(path, objects=[wanted] if wanted else [])  # files on read
        if fmt == "dcp":
            export_dcp(loc, reader, wanted, output)
        else:
            export_safetensors(loc, reader, wanted, output, save_file, only_trainable)
