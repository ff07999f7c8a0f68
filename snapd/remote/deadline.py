"""A bound on the remote work a run's start does, and the line a late answer never crosses.

restore() asks the remote tier for newer commits and pulls one (snapd_client/
fromremote.py). A store that accepts connections and never answers would hold it for
as long as the S3 client's own read timeouts and retries last (77 s with
``AWS_MAX_ATTEMPTS=1``, minutes with botocore's defaults). ``Options.remote_timeout``
bounds the whole of that work, not each call: the work runs on a thread of its own,
and the caller waits for it until the deadline, then goes on from the local disk.

Why bytes arriving push the deadline out: a new node's restore pulls a snapshot of
any size, and cutting a download that is making progress would resume that node from
an older snapshot (or from step 0) for no fault of the store. So the deadline is a
bound on *silence*: it passes when ``remote_timeout`` seconds go by with the work
neither finished nor showing progress (``run``'s ``progress``: the bytes a pull has
written to its tmp names so far). Verifying what was downloaded is local work, not
the store's silence: the pull does it under :meth:`Deadline.local_work`, which
suspends the deadline and starts it afresh after.

Why a thread left behind cannot hurt: every step that makes the work's result visible
in the root (the rename that commits a pulled snapshot, LATEST, the log segments
moved into place) runs inside :meth:`Deadline.publishing`, under the deadline's lock.
:meth:`Deadline.stop` takes the same lock, so once it returns either the work had
published (and the caller sees it on disk) or it never will: a late pull cannot
commit a snapshot after restore chose another one. Its downloads only ever land in
its own tmp names, which it removes as it fails. The S3 calls themselves are bounded
by the same number of seconds each (layout.RemoteRoot ``timeout``), so the thread
ends soon after, rather than when botocore gives up.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from snapd.errors import RemoteUnavailable

POLL = 0.25   # seconds between looks at a long pull's progress


class Deadline:
    """``seconds`` from now (None: never) for the remote work of ``url``."""

    def __init__(self, seconds: Optional[float] = None, url: str = "") -> None:
        self.seconds, self.url = seconds, url
        self._end = None if seconds is None else time.monotonic() + seconds
        self._lock = threading.Lock()
        self._stopped = False    # the caller went on without the work
        self._finished = False   # the work ended before that
        self._local = False      # local_work(): the remote's silence is not measured

    def remaining(self) -> Optional[float]:
        if self._end is None or self._local:
            return None
        return max(0.0, self._end - time.monotonic())

    def extend(self) -> None:
        """Progress seen: ``seconds`` from now again."""
        if self.seconds is not None and not self._local:
            self._end = time.monotonic() + self.seconds

    @contextmanager
    def local_work(self) -> Iterator[None]:
        """Inside, the work reads and writes the local disk only (verifying a
        download): no deadline; after it, ``seconds`` from then."""
        self._local = True
        try:
            yield
        finally:
            self._local = False
            self.extend()

    def check(self, what: str) -> None:
        """Before a step that writes: refuse it once the caller went on."""
        if self._stopped:
            raise self._refusal(what)

    @contextmanager
    def publishing(self, what: str) -> Iterator[None]:
        """A step that makes the work visible in the root: done whole before
        :meth:`stop` returns, or not at all."""
        with self._lock:
            if self._stopped:
                raise self._refusal(what)
            yield

    def stop(self) -> bool:
        """The caller goes on without the work; True when the work had not ended
        (nothing it does from now on is published)."""
        with self._lock:
            self._stopped = not self._finished
            return self._stopped

    def finish(self, deliver: Callable[[], None]) -> bool:
        """The work ended: ``deliver`` its outcome, unless the caller had already gone
        on without it (False); one step under the lock, so that a caller that finds
        the work finished also finds its outcome."""
        with self._lock:
            self._finished = not self._stopped
            if self._finished:
                deliver()
            return self._finished

    def run(self, work: Callable[[], Any], name: str,
            progress: Optional[Callable[[], int]] = None) -> "Outcome":
        """``work()`` on a daemon thread; its outcome, or a timed-out one when the
        deadline passed first (then the work publishes nothing more). A change in
        ``progress()`` (looked at every POLL seconds) pushes the deadline out."""
        outcome = Outcome()

        def body() -> None:
            try:
                value, error = work(), None
            except BaseException as e:   # handed to the caller, raised there
                value, error = None, e
            self.finish(lambda: outcome.deliver(value, error))

        thread = threading.Thread(target=body, name=name, daemon=True)
        thread.start()
        try:
            self._wait(thread, progress)
        finally:   # an interrupt of the caller stops the work as the deadline does
            outcome.timed_out = self.stop()
        return outcome

    def _wait(self, thread: threading.Thread,
              progress: Optional[Callable[[], int]]) -> None:
        seen = progress() if progress is not None else None
        while thread.is_alive():
            left = self.remaining()
            if left == 0.0:
                return
            thread.join(POLL if left is None else min(left, POLL))
            now = progress() if progress is not None else None
            if now != seen:   # bytes arrived: the store answers, slowly or not
                seen = now
                self.extend()

    def _refusal(self, what: str) -> RemoteUnavailable:
        why = "the caller was interrupted" if self.seconds is None else \
            f"remote_timeout={self.seconds:g} s passed"
        return RemoteUnavailable(
            f"remote {self.url}: {what} not done: {why} and the start went on without "
            "the remote; raise remote_timeout if the store is slow rather than silent",
            path=self.url, field="remote_timeout")


class Outcome:
    """What :meth:`Deadline.run` saw: the work's value or error, or ``timed_out``."""

    def __init__(self) -> None:
        self.value: Any = None
        self.error: Optional[BaseException] = None
        self.timed_out = False

    def deliver(self, value: Any, error: Optional[BaseException]) -> None:
        self.value, self.error = value, error

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


NO_DEADLINE = Deadline()   # never expires, never stopped: pull's default
