"""The daemon's background uploader: every locally committed snapshot, to the remote.

Never in training's way: the daemon's writer hands a committed snapshot over with
:meth:`Uploader.committed`, which only files a job and returns; one thread of its own
does the uploads (each with ``remote_upload_threads`` transfers), remote retention and
the log's replication. A slow, failing or unreachable remote only delays that thread.

- **Newest wins.** Each run has one pending slot (each rank one more, for parts of a
  multi-rank snapshot not committed locally): a newer snapshot replaces a stale one
  waiting there, so the backlog is one snapshot per run whatever the remote's speed.
  The one being uploaded is finished first.
- **Retries.** A failed upload stays pending (unless a newer one replaced it) and is
  tried again after 1, 2, 4 ... seconds, at most ``remote_retry_max_seconds``; its
  error is the run's ``last_error`` in status until an upload succeeds. Every upload
  step is repeatable (snapd/remote/upload.py), and files already up are skipped.
- **Resume.** When the daemon starts, each run's newest local committed snapshot that
  is newer than the run's newest remote commit is queued: what a killed daemon did not
  finish is uploaded again.
- **Pinned files.** A snapshot is uploaded from hard links in ``.tmp-upload-*`` beside
  it, so local retention may delete it meanwhile (the links are removed after; a
  crash leaves a tmp dir, which the next daemon start collects).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from snapd import format as fmt
from snapd import pins, sharing, signing
from snapd.errors import RemoteUnavailable, SnapdError
from snapd.options import Options
from snapd.remote import retention
from snapd.remote.layout import RemoteRoot, newest
from snapd.remote.logsync import LogSync
from snapd.remote.upload import shared_files, upload_snapshot
from snapd.retention import dir_bytes
from snapd.store import DIR_MODE, TMP_PREFIX, RunStore, SnapshotId, list_runs

log = logging.getLogger(__name__)

UPLOAD_PREFIX = f"{TMP_PREFIX}upload-"
FIRST_RETRY_S = 1.0
# A part waiting for other nodes' parts looks at the remote again after 0.25 s, then
# up to every 2 s: one listing each time.
PARTS_POLL_FIRST_S, PARTS_POLL_MAX_S = 0.25, 2.0


class _PartsPending(Exception):
    """A part is up; the snapshot is not committed remotely yet."""
Key = Tuple[str, Optional[int]]   # (run, None) a snapshot; (run, rank) a rank's part


@dataclass
class Job:
    run: str
    sid: SnapshotId
    nbytes: int = 0
    rank: Optional[int] = None   # a part of a multi-rank snapshot not committed locally
    uploaded: bool = False       # the part is up; waiting for the other nodes' parts

    @property
    def key(self) -> Key:
        return (self.run, self.rank)


@dataclass
class RunState:
    """One run's remote lag, as ``status`` shows it."""
    last: Optional[Dict[str, Any]] = None         # last remote commit: name, step, at
    local: Optional[Tuple[SnapshotId, int]] = None  # newest local commit, its bytes
    uploading: Optional[str] = None
    left: int = 0                                 # bytes of the upload not yet sent
    last_error: Optional[str] = None
    error_at: Optional[float] = None


@dataclass
class _Retry:
    at: float = 0.0
    delay: float = 0.0


class Uploader:
    """Replicates one root's committed snapshots to ``options.remote``."""

    def __init__(self, root: str, options: Options, *, remote: Optional[RemoteRoot] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert options.remote, "the uploader needs options.remote"
        self.root, self.options, self.clock = os.path.abspath(root), options, clock
        self.remote = remote or RemoteRoot(options.remote)
        self.logs = LogSync(self.remote, self.root, threads=options.remote_upload_threads)
        self._cond = threading.Condition()
        self._pending: Dict[Key, Job] = {}
        self._retry: Dict[Key, _Retry] = {}
        self._runs: Dict[str, RunState] = {}
        self._resumed = False
        self._resume_retry = _Retry()
        self.last_error: Optional[str] = None   # listing the remote at start failed
        self._next_log = 0.0
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="snapd-upload")

    # --- the daemon's side ----------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop after the current file transfers (at most ``timeout`` s); what is not
        committed remotely is resumed by the next daemon."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def committed(self, run: str, rank: int, sid: SnapshotId, nbytes: int,
                  complete: bool = True) -> None:
        """A snapshot (or, ``complete`` False, a rank's part) was committed locally:
        file it for upload. Returns at once."""
        job = Job(run, sid, nbytes, None if complete else rank)
        with self._cond:
            state = self._runs.setdefault(run, RunState())
            if complete and (state.local is None or sid >= state.local[0]):
                state.local = (sid, nbytes)
            self._file(job)

    def _file(self, job: Job) -> None:
        old = self._pending.get(job.key)
        if old is None or job.sid >= old.sid:   # newest wins
            self._pending[job.key] = job
            self._cond.notify_all()

    def busy(self) -> bool:
        """An upload is running now (the daemon's idle exit waits for it; one waiting
        to retry does not keep a daemon alive: the next one resumes it)."""
        with self._cond:
            return any(s.uploading for s in self._runs.values())

    def idle(self) -> bool:
        """Nothing pending and nothing being uploaded (tests, benchmarks)."""
        with self._cond:
            return not self._pending and not any(s.uploading for s in self._runs.values())

    # --- status ---------------------------------------------------------------------

    def status(self) -> Dict[str, Any]:
        with self._cond:
            runs = {run: self._run_status(run, s) for run, s in self._runs.items()}
        return {"url": self.remote.url, "runs": runs, "last_error": self.last_error}

    def _run_status(self, run: str, s: RunState) -> Dict[str, Any]:
        pending = self._pending.get((run, None))
        last_step = s.last["step"] if s.last else None
        local_step = s.local[0].step if s.local else None
        behind = 0 if local_step is None else max(0, local_step - (last_step or 0))
        if s.local is not None and s.last is not None and s.last["name"] == s.local[0].name:
            behind = 0
        waiting = (pending.nbytes if pending is not None else 0) + s.left
        return {"last": s.last, "pending": pending.sid.name if pending else None,
                "uploading": s.uploading, "steps_behind": behind,
                "bytes_behind": waiting, "last_error": s.last_error,
                "error_at": s.error_at}

    # --- the thread -----------------------------------------------------------------

    def _loop(self) -> None:
        _yield_cpu_to_training()
        while True:
            job = self._next()
            if job is False:
                return
            try:
                if not self._resumed and self.clock() >= self._resume_retry.at:
                    self._try_resume()
                if job is not None:
                    self._run(job)
                if self.clock() >= self._next_log:
                    self._sync_logs()
            except Exception as e:   # a bug must not end replication for good
                log.warning("remote uploader: %r", e)
                time.sleep(FIRST_RETRY_S)

    def _next(self) -> Any:
        """The next job whose retry time has come; None when it is time for the log
        or the resume scan; False once stopping."""
        with self._cond:
            while not self._stopping:
                now = self.clock()
                ready = [j for k, j in self._pending.items()
                         if self._retry.get(k, _Retry()).at <= now]
                if ready:
                    job = ready[0]
                    del self._pending[job.key]
                    return job
                if (not self._resumed and now >= self._resume_retry.at) \
                        or now >= self._next_log:
                    return None
                wake = min([self._next_log] + [self._retry[k].at for k in self._pending
                                                if k in self._retry]
                           + ([] if self._resumed else [self._resume_retry.at]))
                self._cond.wait(max(0.01, wake - now))
            return False

    def _try_resume(self) -> None:
        try:
            self._resume()
            self.last_error = None
        except Exception as e:   # the remote is down: jobs filed meanwhile wait too
            r = self._resume_retry
            r.delay = min(self.options.remote_retry_max_seconds, max(FIRST_RETRY_S, r.delay * 2))
            r.at = self.clock() + r.delay
            self.last_error = f"{type(e).__name__}: {e}"
            log.warning("remote %s: cannot list what is committed there (retry in "
                        "%.0f s): %s", self.remote.url, r.delay, e)

    def _resume(self) -> None:
        """Queue each run's newest local commit that the remote does not have yet."""
        for run in list_runs(self.root):
            local = RunStore(self.root, run).committed()
            remote = self.remote.commits(run)
            last = newest(remote)
            with self._cond:
                state = self._runs.setdefault(run, RunState())
                if last is not None and state.last is None:
                    state.last = {"name": last.name, "step": last.step, "at": None}
                if local and (state.local is None or local[-1] > state.local[0]):
                    state.local = (local[-1], _dir_bytes(RunStore(self.root, run), local[-1]))
                if local and (last is None or local[-1] > last):
                    log.info("run %r: %s is not committed remotely yet; uploading it",
                             run, local[-1].name)
                    self._file(Job(run, local[-1], state.local[1]))
                for job in _unfinished_parts(RunStore(self.root, run), last, local):
                    self._file(job)
        self._resumed = True

    def _run(self, job: Job) -> None:
        store = RunStore(self.root, job.run)
        with self._cond:
            state = self._runs.setdefault(job.run, RunState())
            state.uploading, state.left = job.sid.name, job.nbytes
        try:
            record = self._upload(store, job, state)
        except _PartsPending:
            self._wait_for_parts(job)
            return
        except RemoteUnavailable as e:
            self._failed(job, state, e)
            return
        except (SnapdError, ImportError) as e:   # nothing a retry would change: the
            # local snapshot is gone, or node-local parts without snapd.remote.parts
            log.warning("run %r: %s not uploaded: %s", job.run, job.sid.name, e)
            return
        except Exception as e:   # unforeseen (a local read, a library's own error)
            self._failed(job, state, e)
            return
        finally:
            with self._cond:
                state.uploading, state.left = None, 0
        self._succeeded(job, state, record)

    def _upload(self, store: RunStore, job: Job, state: RunState) -> Optional[Dict[str, Any]]:
        def progress(n: int) -> None:
            with self._cond:
                state.left = max(0, state.left - n)
        threads = self.options.remote_upload_threads
        # Read for each job, as the writer does: a key file rotated meanwhile counts.
        keys = signing.load_keys(self.options.signing_key_file)
        if job.rank is not None and not os.path.isdir(store.snapshot_path(job.sid)):
            from snapd.remote import parts   # node-local roots (docs/remote.md)
            if not job.uploaded:   # a job waiting for other nodes only looks again
                parts.upload_part(self.remote, store, job.sid.name, job.rank,
                                  threads=threads)
                job.uploaded = True
            if not parts.settle_part(self.remote, store, job.sid.name, keys):
                raise _PartsPending()   # another node's parts are not all up yet
            return self.remote.read_record(job.run, job.sid.name)
        with pinned(store, job.sid) as pin:
            return upload_snapshot(self.remote, pin, job.sid.name, threads=threads,
                                   progress=progress, signer=keys)

    def _wait_for_parts(self, job: Job) -> None:
        """A part is up but the set is not: look again later (not an error; a newer
        snapshot's part replaces the job, newest wins)."""
        with self._cond:
            retry = self._retry.setdefault(job.key, _Retry())
            retry.delay = min(PARTS_POLL_MAX_S, max(PARTS_POLL_FIRST_S, retry.delay * 2))
            retry.at = self.clock() + retry.delay
            if job.key not in self._pending:
                self._pending[job.key] = job

    def _failed(self, job: Job, state: RunState, error: BaseException) -> None:
        with self._cond:
            retry = self._retry.setdefault(job.key, _Retry())
            retry.delay = min(self.options.remote_retry_max_seconds,
                              max(FIRST_RETRY_S, retry.delay * 2))
            retry.at = self.clock() + retry.delay
            state.last_error, state.error_at = f"{type(error).__name__}: {error}", time.time()
            if job.key not in self._pending:
                self._pending[job.key] = job   # unless a newer one came meanwhile
        log.warning("run %r: uploading %s failed (retry in %.0f s): %s", job.run,
                    job.sid.name, retry.delay, error)

    def _succeeded(self, job: Job, state: RunState, record: Optional[Dict[str, Any]]) -> None:
        with self._cond:
            self._retry.pop(job.key, None)
            state.last_error = state.error_at = None
            if record is not None and (state.last is None or
                                       job.sid >= SnapshotId.parse(state.last["name"])):
                state.last = {"name": record["name"], "step": record["step"],
                              "at": record.get("uploaded_at")}
        if record is None:
            return
        self._after_commit(job.run)

    def _after_commit(self, run: str) -> None:
        """Remote retention and the log, after each remote commit; their failures are
        logged and retried with the next commit."""
        try:
            retention.apply(self.remote, run, self.options.remote_keep_last,
                            self.options.remote_keep_every,
                            pins.pinned(RunStore(self.root, run).path))
        except Exception as e:
            log.warning("run %r: remote retention failed (everything kept): %r", run, e)
        try:
            self.logs.sync(run)
        except Exception as e:
            log.warning("run %r: replicating the state log failed: %r", run, e)

    def _sync_logs(self) -> None:
        self._next_log = self.clock() + self.options.remote_log_interval
        for run in self.logs.runs_with_log():
            try:
                self.logs.sync(run)
            except Exception as e:
                log.warning("run %r: replicating the state log failed: %r", run, e)
                return   # the remote is likely down: try again next interval


def _yield_cpu_to_training() -> None:
    """Replication is the least urgent work on the node: this thread, the threads it
    starts (file transfers) and fsspec's I/O loop run as SCHED_IDLE (else at nice
    10), so that they take the CPU only when training and the local commits leave it:
    measured, the snapshot() stall with uploads running went from 2.7x to 1.02x the
    stall without (docs/benchmarks.md). Linux keeps the policy per thread, and new
    threads inherit it. Refused or unsupported: the default priority, only slower."""
    _lower_this_thread()
    asyn = sys.modules.get("fsspec.asyn")   # s3fs's requests run on its loop's thread
    if asyn is not None:
        asyn.get_loop().call_soon_threadsafe(_lower_this_thread)


def _lower_this_thread() -> None:
    try:   # SCHED_IDLE: only on a CPU nothing else wants (Linux, per thread)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, 0, max(os.getpriority(os.PRIO_PROCESS, 0), 10))
    except (AttributeError, OSError):
        pass


def _unfinished_parts(store: RunStore, last: Optional[SnapshotId],
                      local: List[SnapshotId]) -> List[Job]:
    """Node-local roots: each rank's part in the newest ``.parts-*`` directory newer
    than every commit, local or remote (a daemon killed before it uploaded them)."""
    found = store.parts_dirs()
    if not found:
        return []
    sid, path = found[-1]
    if (last is not None and sid <= last) or (local and sid <= local[-1]):
        return []
    ranks = [int(n[len("rank-"):]) for n in os.listdir(path)
             if n.startswith("rank-") and n[len("rank-"):].isdigit()]
    return [Job(store.run, sid, 0, rank) for rank in sorted(ranks)]


def _dir_bytes(store: RunStore, sid: SnapshotId) -> int:
    return dir_bytes(store.snapshot_path(sid))


class _Pinned(RunStore):
    """A RunStore whose ``snapshots/`` is the upload's tmp dir of hard links, and whose
    ``shared_pins`` holds links to the shared files its snapshot reads
    (``<snapshot>/<file>``)."""

    def __init__(self, store: RunStore, snapshots_path: str) -> None:
        super().__init__(store.root, store.run)
        self.snapshots_path = snapshots_path
        self.shared_pins = os.path.join(snapshots_path, "shared")


@contextmanager
def pinned(store: RunStore, sid: SnapshotId) -> Iterator[RunStore]:
    """The committed snapshot's files hard-linked into ``.tmp-upload-<name>-<nonce>/``,
    so that a local retention run meanwhile cannot take them away mid-upload. Where
    links cannot be made (another filesystem's rules), the snapshot itself is used."""
    src = store.snapshot_path(sid)
    if not os.path.isdir(src):
        raise SnapdError(f"{src}: no committed snapshot to upload (deleted by retention "
                         "meanwhile?)", path=src, field="name")
    tmp = os.path.join(store.snapshots_path, f"{UPLOAD_PREFIX}{sid.name}-{secrets.token_hex(4)}")
    try:
        shutil.copytree(src, os.path.join(tmp, sid.name), copy_function=os.link)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(src):
            raise SnapdError(f"{src}: deleted by retention before its upload", path=src,
                             field="name") from e
        log.debug("no hard links for %s (%s); uploading in place", src, e)
        yield store
        return
    try:
        pin = _Pinned(store, tmp)
        _pin_shared(store, pin.snapshot_path(sid), pin.shared_pins)
        yield pin
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _pin_shared(store: RunStore, path: str, pins: str) -> None:
    """Hard links to the shared files the snapshot reads (format v4), so that local
    retention sweeping ``shared/`` meanwhile cannot take them away mid-upload either.
    A file that moves from ``snapshots/<S>/`` to ``shared/<S>/`` while it is linked
    is looked for again; one not linked is read where it is found at upload."""
    manifest = os.path.join(path, fmt.MANIFEST_NAME)
    if os.path.exists(os.path.join(path, fmt.COMMIT_NAME)) or not os.path.exists(manifest):
        return
    with open(manifest, "rb") as f:
        shared = shared_files(f.read(), manifest)
    for s in shared:
        os.makedirs(os.path.join(pins, s.snapshot), DIR_MODE, exist_ok=True)
        for _ in range(3):
            try:
                os.link(sharing.locate(store.path, s.snapshot, s.file, wanted_by=manifest),
                        os.path.join(pins, s.snapshot, s.file))
                break
            except FileNotFoundError:   # renamed away between locate and link
                continue
            except (OSError, SnapdError) as e:
                log.debug("%s of %s not pinned (%s); read where found", s.file,
                          s.snapshot, e)
                break
