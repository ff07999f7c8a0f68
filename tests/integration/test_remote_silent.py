"""A remote store that accepts connections and never answers: restore() waits at most
``remote_timeout`` for it, warns once, and resumes from the local snapshot.

The store is a real listening socket on 127.0.0.1 (never another address) that
accepts every connection and reads nothing, used as the S3 endpoint through the AWS
variables, as the moto tests use theirs. Without the bound, botocore's read timeouts
and retries under s3fs's kept restore() there for about 80 s.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import warnings

import pytest
import s3fs  # noqa: F401  imported ahead: its import is not what the bound measures
import torch

from helpers import wait_until
from snapd.store import RunStore, SnapshotId
from snapd_client import Client
from snapd_client.fromremote import RemoteWarning

RUN = "r"
TIMEOUT = 5.0   # remote_timeout given to the Client: room for the S3 client's setup
MARGIN = 5.0    # the local restore after it, on a busy machine


class SilentStore:
    """Accepts on 127.0.0.1 and never answers; keeps each connection open."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.accepted: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="silent-store",
                                        daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return "http://127.0.0.1:%d" % self.sock.getsockname()[1]

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            self.accepted.append(conn)   # held open, never read, never answered

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for conn in self.accepted:
            conn.close()
        self.sock.close()


@pytest.fixture
def silent(monkeypatch):
    store = SilentStore()
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_ENDPOINT_URL": store.endpoint}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)   # botocore's own retries on
    yield store
    store.close()


def model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train_to_snapshot(root: str, step: int) -> dict:
    """A run with a local snapshot at ``step`` (no remote); its model's weights."""
    model, opt = model_and_opt()
    client = Client(root, RUN, daemon=False)
    client.track(model=model, optimizer=opt)
    assert client.restore() == 0
    for s in range(1, step + 1):
        model.weight.data.add_(0.1)
        client.log(s, loss=1.0 / s)
    client.snapshot(step).wait()
    client.close()
    return {k: v.clone() for k, v in model.state_dict().items()}


def root_listing(root: str) -> list:
    return sorted(os.path.relpath(os.path.join(d, n), root)
                  for d, dirs, files in os.walk(root) for n in dirs + files)


def test_restore_from_a_silent_store_is_bounded_and_resumes_locally(tmp_path, silent):
    root = str(tmp_path / "root")
    trained = train_to_snapshot(root, 3)
    url = "s3://snapd-test/silent"
    model, opt = model_and_opt()
    client = Client(root, RUN, daemon=False, remote=url, remote_timeout=TIMEOUT)
    client.track(model=model, optimizer=opt)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        began = time.monotonic()
        step = client.restore()
        took = time.monotonic() - began
    assert step == 3 and client.restored_from == "disk"
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.items())
    assert took < TIMEOUT + MARGIN, f"restore() took {took:.1f} s"
    wait_until(lambda: silent.accepted, timeout=10, what="the store's accept")
    said = [str(w.message) for w in seen if issubclass(w.category, RemoteWarning)]
    assert said == [f"the remote tier {url} did not answer within remote_timeout=5 s "
                    f"(listing the commits of {RUN}); restoring from the local disk "
                    "only. Raise remote_timeout if the store is slow rather than silent"]
    # The pull left behind ends on its own call's bound, and publishes nothing.
    listing = root_listing(root)
    wait_until(lambda: not any(t.name == f"snapd-remote-pull-{RUN}"
                               for t in threading.enumerate()),
               timeout=30, what="the abandoned pull's thread to end")
    assert root_listing(root) == listing
    assert RunStore(root, RUN).committed() == [SnapshotId(0, 3)]
    client.close()
