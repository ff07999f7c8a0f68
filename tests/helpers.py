"""Helpers the tests import: stopping the daemons a test started, shared trained
roots, damaging files on purpose. Fixtures live in conftest.py; these are plain
functions, imported by name (``from helpers import flip_byte``)."""

from __future__ import annotations

import os
import shutil
import signal

import psutil

from snapd import format as fmt
from snapd.names import ROOT_LOCK_NAME


def stop_daemons_under(base: str, timeout: float = 20.0) -> None:
    """SIGTERM every daemon whose root lies under ``base`` (it drains, then exits);
    SIGKILL what is still alive after ``timeout``."""
    procs = []
    for dirpath, _dirs, files in os.walk(base):
        if ROOT_LOCK_NAME not in files:
            continue
        try:
            with open(os.path.join(dirpath, ROOT_LOCK_NAME)) as f:
                proc = psutil.Process(int(f.read().strip() or 0))
            if "snapd" in " ".join(proc.cmdline()):
                proc.send_signal(signal.SIGTERM)
                procs.append(proc)
        except (OSError, ValueError, psutil.Error):
            continue
    _gone, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        proc.kill()


def trained_root(tmp_path_factory, name: str, train) -> str:
    """A root that ``train(root)`` filled once: the pristine copy a test module shares."""
    root = str(tmp_path_factory.mktemp(name) / "root")
    os.mkdir(root)
    train(root)
    return root


def private_copy(pristine: str, tmp_path) -> str:
    """A private copy of a pristine root, free to damage."""
    path = str(tmp_path / "root")
    shutil.copytree(pristine, path)
    return path


def outside_listing(root: str) -> list:
    """Everything in tmp_path outside the root: must not change under hostile input."""
    base = os.path.dirname(root)
    found = []
    for dirpath, _dirs, files in os.walk(base):
        if dirpath.startswith(root):
            continue
        found += [os.path.join(dirpath, f) for f in files]
    return sorted(found)


def flip_byte(path: str, offset: int, mask: int = 0xFF) -> None:
    """Damage one byte of a real file in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))


def read_manifest(snapshot_dir: str) -> dict:
    with open(os.path.join(snapshot_dir, fmt.MANIFEST_NAME), "rb") as f:
        return fmt.decode_manifest(f.read(), path=snapshot_dir)


def write_manifest_raw(snapshot_dir: str, manifest: dict) -> None:
    """Rewrite a manifest with a *valid* header and checksum: a hostile, not torn, file."""
    with open(os.path.join(snapshot_dir, fmt.MANIFEST_NAME), "wb") as f:
        f.write(fmt.encode_manifest(manifest))
