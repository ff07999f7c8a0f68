"""Shared fixtures: a scratch root with a sentinel beside it, and snapshot builders."""

from __future__ import annotations

import os
import shutil
import signal

import psutil
import pytest
import torch

from snapd import format as fmt


@pytest.fixture(autouse=True, scope="session")
def _snapshots_in_process():
    """Unit tests write snapshots in-process (Options.daemon=False, inherited by the
    trainer subprocesses they start): a daemon started for each tmp root would outlive
    the test. Set for the session so that module-scoped fixtures see it too."""
    before = os.environ.get("SNAPD_DAEMON")
    os.environ["SNAPD_DAEMON"] = "0"
    yield
    if before is None:
        os.environ.pop("SNAPD_DAEMON", None)
    else:
        os.environ["SNAPD_DAEMON"] = before


@pytest.fixture(scope="session", autouse=True)
def _no_daemon_left(tmp_path_factory):
    """Whatever a test forgot, no daemon started under the session's tmp dirs outlives it."""
    yield
    stop_daemons_under(str(tmp_path_factory.getbasetemp()))


@pytest.fixture(autouse=True)
def _daemon_for_integration(request, monkeypatch):
    """Tests marked ``integration`` use the real daemon (and stop it themselves)."""
    if request.node.get_closest_marker("integration") is not None:
        monkeypatch.delenv("SNAPD_DAEMON", raising=False)


def stop_daemons_under(base: str, timeout: float = 20.0) -> None:
    """SIGTERM every daemon whose root lies under ``base`` (it drains, then exits);
    SIGKILL what is still alive after ``timeout``."""
    procs = []
    for dirpath, _dirs, files in os.walk(base):
        if ".snapd.lock" not in files:
            continue
        try:
            with open(os.path.join(dirpath, ".snapd.lock")) as f:
                proc = psutil.Process(int(f.read().strip() or 0))
            if "snapd" in " ".join(proc.cmdline()):
                proc.send_signal(signal.SIGTERM)
                procs.append(proc)
        except (OSError, ValueError, psutil.Error):
            continue
    _gone, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        proc.kill()


@pytest.fixture
def root(tmp_path):
    """A checkpoint root inside tmp_path, with a sibling folder to catch escapes."""
    (tmp_path / "outside").mkdir()
    path = tmp_path / "root"
    path.mkdir()
    return str(path)


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


class Counter(torch.nn.Module):
    """A small module plus an optimizer, enough to make real snapshots quickly."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 32)
