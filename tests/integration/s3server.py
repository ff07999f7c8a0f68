"""A real S3 API server for the remote-tier tests: moto's standalone server, a
separate process bound to 127.0.0.1 on a free port (never any other address).

``S3Server.start()`` waits until it answers and creates the bucket; ``kill()`` is a
SIGKILL (the remote lost mid-upload); ``restart()`` brings it back on the same port
with the bucket (moto keeps objects in memory: a restarted server is empty, like a
store that lost everything, which is the harder case for the uploader). ``env`` is
what a process needs to reach it: dummy credentials and the endpoint, through the
usual AWS variables, never through snapd's own settings.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from typing import Dict, Optional

HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, bucket: str = "snapd-test") -> None:
        self.port = _free_port()
        self.bucket = bucket
        self.proc: Optional[subprocess.Popen] = None

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def env(self) -> Dict[str, str]:
        # One attempt per call: snapd's uploader retries whole steps itself. With
        # botocore's default retries under s3fs's own, a killed server took 37 s to
        # show as an error in `snapd status`.
        return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_MAX_ATTEMPTS": "1"}

    def url(self, prefix: Optional[str] = None) -> str:
        """A fresh prefix in the bucket (one per test keeps tests apart)."""
        return f"s3://{self.bucket}/{prefix or uuid.uuid4().hex[:12]}"

    def start(self, timeout: float = 30.0) -> "S3Server":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, **self.env})
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection((HOST, self.port), 0.2).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server on {self.endpoint} did not start "
                                       f"(exit {self.proc.poll()}); pip install "
                                       "'moto[server]'")
                time.sleep(0.05)
        self._make_bucket()
        return self

    def _make_bucket(self) -> None:
        import s3fs
        fs = s3fs.S3FileSystem(key="testing", secret="testing",
                               endpoint_url=self.endpoint, skip_instance_cache=True)
        fs.mkdir(self.bucket)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        self.kill()
        self.proc = None
