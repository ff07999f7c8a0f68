"""The daemon: one per root. Wires the lock, the server, the writers and retention.

Lifecycle of :meth:`Daemon.serve_forever`:

1. Take ``<root>/.snapd.lock`` (snapd/rootlock.py: flock, non-blocking; the holder's
   pid in it). Held by another daemon: :class:`AlreadyServing`, exit code 2.
2. Collect ``.tmp-*`` directories under every run: with the lock held nothing else
   writes there, so they are writes a dead daemon abandoned.
3. Replace a stale socket, listen, accept (snapd/server.py).
4. SIGTERM or SIGINT: stop accepting, refuse new submits, finish every accepted
   snapshot (events still go to connected clients), close connections, unlink the
   socket, release the lock, exit 0.
5. The same, unasked, when the socket file is no longer ours (checked every
   ``root_check_seconds``): the root was deleted or the socket removed, so no new
   client can reach this daemon, and a daemon nobody can reach would hold its hot
   copies in memory forever. A socket another daemon bound since is left alone.
6. The same on a ``stop`` request (``snapd stop ROOT``), and when idle: no trainer
   connected (tools such as ``status`` and ``watch`` do not count) and nothing in
   flight for ``idle_exit_seconds`` (0: never), counted from the last trainer's
   disconnect or the last write's end, whichever is later. A daemon is cheap to start
   again (a client starts one when none answers), while one per root kept forever
   costs 40-60 MB each. The default outlasts ``hot_linger_seconds``, so a crashed
   trainer restarted within it still finds its hot copy. A daemon that keeps nothing
   (no hot copy held, no upload pending) exits after the shorter
   ``idle_bare_exit_seconds``: a sweep of short runs in separate roots leaves no
   pile of idle daemons.

One snapshot (after ``accepted``): the commit service (snapd/commit.py: space check,
write, error mapping, tmp cleanup, retention), then the committed slot held as the
run's hot copy (snapd/arena_map.py, ``HotCache``), then, in
a ``finally``, the slot freed and exactly one event sent: ``committed`` when the
snapshot is on disk (a later step that failed is logged as a warning; the snapshot
stands), ``failed`` with the error otherwise. Snapshots of one run are written
strictly in submission order; different runs share ``writer_threads`` workers.

The daemon logs through ``logging.getLogger("snapd.daemon")`` (and the library's
loggers under "snapd"); in the daemon process every line is stamped with the time
and ``snapd[pid]`` (:data:`LINE_FORMAT`).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

import psutil

from snapd import diskguard, signing, stderrlog, protocol as p, retention
from snapd.arena_map import HotCache, reclaim_dead_arenas
from snapd.commit import Commit, CommitService
from snapd.cpulanes import shared as shared_lanes
from snapd.errors import AlreadyServing, SnapdError
from snapd.hotwhy import never_held, not_held_because
from snapd.options import DAEMON_OPTIONS, Options
from snapd.remote.uploader import Uploader
from snapd.rootlock import RootLock
from snapd.server import Server, Submission
from snapd.store import RunStore, list_runs
from snapd.writer import CommitResult, write_snapshot

EXIT_ALREADY_SERVING = 2
LINE_FORMAT = "%(asctime)s snapd[%(process)d] %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"

logger = logging.getLogger(__name__)


class WriteQueue:
    """One FIFO per run and rank on a shared pool: a rank's snapshots strictly in
    order, the ranks of one job side by side.

    After each job a queue's next job goes to the back of the pool's queue, so one
    busy run cannot starve the others.
    """

    def __init__(self, threads: int, work: Callable[[Submission], None]) -> None:
        self._work = work
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="snapd-write")
        self._queues: Dict[Tuple[str, int], Deque[Submission]] = {}
        self._active: Set[Tuple[str, int]] = set()   # queues with a job scheduled or running
        self.running: Dict[Tuple[str, int], Submission] = {}
        self._count = 0
        self._closed = False
        self._cond = threading.Condition()

    def put(self, sub: Submission) -> None:
        with self._cond:
            if self._closed:
                raise SnapdError("the daemon is stopping and accepts no new snapshot; "
                                 "submit again once a new daemon serves the root")
            key = (sub.run, sub.rank)
            self._queues.setdefault(key, deque()).append(sub)
            self._count += 1
            if key not in self._active:
                self._active.add(key)
                self._pool.submit(self._one, key)

    def _one(self, key: Tuple[str, int]) -> None:
        with self._cond:
            sub = self._queues[key].popleft()
            self.running[key] = sub
        try:
            self._work(sub)
        except Exception as e:   # _work reports its own failures; this is a bug
            log(f"internal error writing run {sub.run!r} step {sub.step}: {e!r}")
        finally:
            with self._cond:
                self._count -= 1
                del self.running[key]
                if self._queues[key]:
                    self._pool.submit(self._one, key)
                else:
                    del self._queues[key]
                    self._active.discard(key)
                self._cond.notify_all()

    def snapshot(self) -> List[Submission]:
        """Running and queued submissions, running first."""
        with self._cond:
            return list(self.running.values()) + \
                [s for q in self._queues.values() for s in q]

    def drain(self) -> None:
        """Refuse new work, wait for every queued and running job, stop the pool."""
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: self._count == 0)
        self._pool.shutdown(wait=True)


def log(message: str) -> None:
    """One line of the daemon's log (the server calls it through its handler)."""
    logger.info(message)


class Daemon:
    """Serves one root until SIGTERM/SIGINT, a ``stop`` request, or idle (see above)."""

    def __init__(self, root: str, options: Optional[Options] = None, *,
                 writer: Callable[..., CommitResult] = write_snapshot,
                 retain: Callable[..., retention.RetentionResult] =
                 retention.apply_retention) -> None:
        self.root = os.path.abspath(root)
        self.options = options or Options.resolve()
        # writer, retain: the commit service's; tests substitute faulty ones.
        self.commits = CommitService(self.root, self.options.min_free_bytes,
                                     writer=writer, retain=retain)
        self.started = time.time()
        self.lock = RootLock(self.root)
        self.server = Server(self.root, self)
        self.writes = WriteQueue(self.options.writer_threads, self._write)
        self.hot_cache = HotCache(max_bytes=self.options.hot_max_bytes)
        self._hot_told: Dict[Tuple[str, int], str] = {}   # the miss last logged
        self.runs: Dict[str, Dict[str, Any]] = {}
        # The remote tier (docs/remote.md): its own thread, never in a write's way.
        self.uploader = Uploader(self.root, self.options) if self.options.remote else None
        self._process = psutil.Process()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._stopping = False
        self._last_busy = time.monotonic()   # a trainer left or a write ended (idle exit)

    log = staticmethod(log)

    # --- lifecycle ----------------------------------------------------------------

    def serve_forever(self) -> int:
        """Run until stopped; returns the exit code. Raises AlreadyServing."""
        os.makedirs(self.root, mode=0o700, exist_ok=True)  # only when we create it
        self.lock.acquire()
        try:
            self._collect_abandoned()
            self.server.bind()
            self._install_signals()
            if self.uploader is not None:
                self.uploader.start()
            remote = f", replicating to {self.uploader.remote.url}" if self.uploader else ""
            log(f"serving {self.root} (protocol {p.PROTOCOL_VERSION}){remote}")
            self.server.serve(self._wake_r, check_every=self._check_every(),
                              keep_serving=self._keep_serving)
            self.server.stop_accepting()
            pending = len(self.writes.snapshot())
            log(f"stopping: finishing {pending} accepted snapshot(s)")
            self.writes.drain()
            if self.uploader is not None:   # what is not up yet, the next daemon resumes
                self.uploader.stop()
            self.server.close_connections()
            self.hot_cache.close()
        finally:
            self.server.unlink_socket()
            self.lock.release()
            os.close(self._wake_r)
            os.close(self._wake_w)
        log("stopped")
        return 0

    def stop(self) -> None:
        """Ask serve_forever to drain and return (safe from a signal handler)."""
        self._stopping = True
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass   # already woken

    def _check_every(self) -> float:
        """How often _keep_serving is asked: root_check_seconds, or more often when
        the shorter idle exit is shorter, so that it is not late by more than a fifth."""
        idle = self._idle_limit(keeps_nothing=True)
        every = self.options.root_check_seconds
        return min(every, max(0.05, idle / 5)) if idle > 0 else every

    def _keep_serving(self) -> bool:
        """Asked every _check_every(): also the time to let go of old hot copies."""
        self._expire_hot()
        if not self.server.owns_socket():
            log(f"{self.server.path} was removed or replaced (root deleted?); no new "
                "client can reach this daemon: stopping")
            return False
        return not self._idle_too_long()

    def _idle_too_long(self) -> bool:
        """No trainer connected and nothing in flight for the idle limit that applies
        now (see :meth:`_idle_limit`)."""
        bare = self._keeps_nothing()
        limit = self._idle_limit(bare)
        if limit <= 0:
            return False
        if self._busy():
            self._last_busy = time.monotonic()
            return False
        if time.monotonic() - self._last_busy < limit:
            return False
        if limit < self.options.idle_exit_seconds:
            log(f"no client, nothing in flight and nothing kept (no hot copy, no "
                f"pending upload) for {limit:g} s (idle_bare_exit_seconds): stopping")
        else:
            log(f"no client and nothing in flight for {limit:g} s (idle_exit_seconds): "
                "stopping")
        return True

    def _busy(self) -> bool:
        """A trainer is connected, a write queued or running, or an upload running:
        the idle time counts from when this stops being true."""
        uploading = self.uploader is not None and self.uploader.busy()
        return bool(self.writes.snapshot()) or uploading or \
            any(c.run for c in self.server.live_connections())

    def _keeps_nothing(self) -> bool:
        """No hot copy held and no upload pending: exiting loses nothing a restarted
        trainer or the remote tier would miss, so the shorter idle limit applies."""
        return self.hot_cache.held_bytes() == 0 and \
            (self.uploader is None or self.uploader.idle())

    def _idle_limit(self, keeps_nothing: bool) -> float:
        """Idle seconds after which this daemon exits (0: never). A daemon started by
        hand has idle_exit_seconds 0 and never exits; one a client started waits
        idle_exit_seconds while it holds a crashed trainer's hot copy (outlasting
        hot_linger_seconds, for a restart), and the shorter idle_bare_exit_seconds
        once it keeps nothing: a sweep of short runs, each in its own root, then
        leaves no pile of idle daemons behind."""
        limit, bare = self.options.idle_exit_seconds, self.options.idle_bare_exit_seconds
        if limit > 0 and keeps_nothing and bare > 0:
            return min(limit, bare)
        return limit

    def idle_seconds(self) -> float:
        """Seconds since the daemon was last busy (0 while it is)."""
        return 0.0 if self._busy() else max(0.0, time.monotonic() - self._last_busy)

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def _collect_abandoned(self) -> None:
        orphans = self.hot_cache.reclaim_orphans()
        if orphans:
            log(f"unlinked {orphans} hot cop(ies) left by dead daemons")
        arenas = reclaim_dead_arenas()
        if arenas:
            log(f"unlinked {arenas} staging arena(s) left by dead clients")
        for run in list_runs(self.root):
            removed = RunStore(self.root, run).collect_tmp()
            if removed:
                log(f"run {run!r}: collected {removed} abandoned tmp dir(s)")

    # --- the Handler interface used by the server ---------------------------------

    def enqueue(self, sub: Submission) -> None:
        self.writes.put(sub)

    def hot(self, run: str, rank: int) -> p.HotReply:
        """The held copy of (run, rank), or why there is none (also logged, once per
        reason, when the run has a committed snapshot a restart could have read)."""
        entry = self.hot_cache.get(run, rank)
        store = RunStore(self.root, run)
        latest = store.read_pointer("LATEST")
        if entry is None:
            reason = self.hot_cache.why_not(run, rank) or \
                never_held(store, latest, self.started)
            if latest is not None:
                self._tell_hot_miss(run, rank, f"no hot copy to restore from: {reason}")
            return p.HotReply(reason=reason)
        if latest is not None and latest.name != entry.snapshot:
            self._tell_hot_miss(run, rank, f"the hot copy is of {entry.snapshot}, LATEST "
                                           f"names {latest.name}: a restore of "
                                           f"{latest.name} reads the files")
        return p.HotReply(entry.shm, entry.snapshot, entry.plan)

    def _tell_hot_miss(self, run: str, rank: int, why: str) -> None:
        """Log why a restart of (run, rank) cannot read memory; once per reason (the
        client asks at its warm-up and again at restore)."""
        if self._hot_told.get((run, rank)) != why:
            self._hot_told[(run, rank)] = why
            log(f"run {run!r} rank {rank}: {why}")

    def client_done(self, run: str, rank: int) -> None:
        """The client closed cleanly: nobody restarts from its hot copy."""
        if self.hot_cache.drop(run, rank, reason="its client closed cleanly"):
            log(f"released the hot copy of run {run!r} rank {rank}: its client is done")

    def hot_release(self, run: str, rank: int) -> None:
        """A restarted client of (run, rank) has restored: the earlier client's held
        snapshot (its whole arena, once that client is gone) is released."""
        if self.hot_cache.drop(run, rank, reason="a later client of the run restored"):
            log(f"released the hot copy of run {run!r} rank {rank}: its new client "
                "has restored")

    def client_left(self, run: str, rank: int, clean: bool) -> None:
        """A client crashed (or hung up without bye): a restart on this node within
        hot_linger_seconds restores from memory; then the copy is released."""
        self._last_busy = time.monotonic()   # the idle exit counts from here
        if not clean:
            self.hot_cache.touch(run, rank)

    def _expire_hot(self) -> None:
        in_use = {(c.run, c.rank) for c in self.server.live_connections() if c.run}
        for run, rank in self.hot_cache.expire(in_use, self.options.hot_linger_seconds):
            log(f"released the hot copy of run {run!r} rank {rank}: no client for "
                f"{self.options.hot_linger_seconds:g} s (hot_linger_seconds)")

    # --- one snapshot ---------------------------------------------------------------

    def _write(self, sub: Submission) -> None:
        """Commit, hold the slot as the hot copy, free it, send one event. Never raises.

        Exactly one event per accepted submit, by structure: the ``finally`` frees
        the slot and sends ``event``, which is ``committed`` from the moment the
        snapshot is on disk, whatever fails after it (that is logged), and
        ``failed`` before. The hot copy is the committed slot itself, held before
        the event (the client then stages into its other slot): no byte is copied.
        """
        sub.started = time.time()
        event: Any = None
        done: Optional[Commit] = None
        try:
            done = self.commits.commit(RunStore(self.root, sub.run), sub.plan,
                                       sub.options, progress=sub.advance)
            event = p.Committed(sub.run, sub.rank, sub.step, sub.slot,
                                done.result.sid.name, done.result.bytes_written,
                                done.result.seconds, done.result.complete,
                                done.result.manifest_sha256)
            self._note_commit(sub, done)
            self._replicate(sub, done)
            self._publish_hot(sub, done.result)
        except Exception as e:
            if event is None:
                event = self._failure(sub, e)
            else:   # the snapshot stands: the client hears committed
                logger.warning("run %r step %d is committed as %s, but a step after "
                               "the commit failed: %r", sub.run, sub.step, event.name, e)
        finally:
            self._finish(sub, event)
            self._last_busy = time.monotonic()
        if done is not None:
            done.purge()   # the slow part of retention's deletes, after the client knows

    def _finish(self, sub: Submission, event: Any) -> None:
        """Free the slot, then send the event.

        Never raises: each step runs whatever the one before did, and a failure is
        logged (a connection that cannot take the event is broken: its client learns
        from the lost connection).
        """
        try:
            sub.release()
        except Exception as e:
            log(f"run {sub.run!r} step {sub.step}: freeing slot {sub.slot} failed: {e!r}")
        if event is None:   # only a bug gets here: still, the client must hear
            event = self._failure(sub, SnapdError("the daemon failed internally"))
        try:
            sub.conn.send_event(event)
        except Exception as e:
            log(f"run {sub.run!r} step {sub.step}: the {event.op} event could not be "
                f"sent: {e!r}")
            return
        if isinstance(event, p.Committed):
            log(f"committed run {sub.run!r} rank {sub.rank} step {sub.step} as "
                f"{event.name}: {event.bytes} bytes in {event.seconds:.2f}s")

    def _note_commit(self, sub: Submission, done: Commit) -> None:
        """The status lines for a commit (the commit service logs retention's deletes)."""
        result = done.result
        self.runs[sub.run] = {"last_committed": result.sid.name, "step": sub.step,
                              "bytes": result.bytes_written,
                              "seconds": round(result.seconds, 3),
                              "committed_at": time.time()}

    def _replicate(self, sub: Submission, done: Commit) -> None:
        """File the commit for upload (returns at once; the uploader's thread works)."""
        if self.uploader is not None:
            result = done.result
            self.uploader.committed(sub.run, sub.rank, result.sid, result.bytes_written,
                                    result.complete)

    @property
    def signing_key_id(self) -> str:
        """The id of the key this daemon's writes are signed with, "" for none (hello
        compares it). Read as the writer reads it, for each: a rotated key file counts."""
        return signing.signer_id(signing.load_keys(self.options.signing_key_file))

    @property
    def remote_url(self) -> str:
        """The remote this daemon replicates to (redacted), or "" (hello, status)."""
        return self.uploader.remote.url if self.uploader is not None else ""

    def _failure(self, sub: Submission, error: BaseException) -> p.Failed:
        """The ``failed`` event for an error, with its path, field and extras."""
        log(f"failed run {sub.run!r} rank {sub.rank} step {sub.step}: "
            f"{type(error).__name__}: {error}")
        return p.Failed.of(sub.run, sub.rank, sub.step, sub.slot, error)

    def _publish_hot(self, sub: Submission, result: CommitResult) -> None:
        """The committed slot becomes the run's hot copy (the one it replaces is the
        client's again); without one, an older copy is no longer the latest snapshot
        and is dropped."""
        refused = not_held_because(sub, self.hot_cache)
        if refused is not None:
            self.hot_cache.refuse(sub.run, sub.rank, result.sid.name, refused)
            return
        try:
            self.hot_cache.publish(sub.run, sub.rank, sub.arena, sub.slot, sub.desc,
                                   result.sid.name)
        except BaseException as e:   # no copy at all beats one that is not the latest
            self.hot_cache.refuse(sub.run, sub.rank, result.sid.name,
                                  f"holding it failed ({type(e).__name__}: {e})")
            raise
        if sub.conn.finished:   # bye came while this was written: nobody will read it
            self.hot_cache.drop(sub.run, sub.rank, reason="its client closed cleanly")

    # --- status -------------------------------------------------------------------

    def status(self) -> Dict[str, Any]:
        return {"pid": os.getpid(), "root": self.root, "started": self.started,
                "runs": dict(self.runs),
                "in_flight": [self._progress(s) for s in self.writes.snapshot()],
                "clients": [{"pid": c.pid, "run": c.run, "rank": c.rank,
                             "alive": _pid_alive(c.pid)}
                            for c in self.server.live_connections()],
                "cpu_percent": self._process.cpu_percent(interval=None),
                "rss": self._process.memory_info().rss,
                "disk_free": diskguard.free_bytes(self.root),
                "remote": self.uploader.status() if self.uploader is not None else None,
                "stopping": self._stopping,
                # The daemon-wide options it applies, whoever started it.
                "options": {n: getattr(self.options, n) for n in DAEMON_OPTIONS},
                "idle_seconds": round(self.idle_seconds(), 3),
                "idle_limit_seconds": self._idle_limit(self._keeps_nothing()),
                "hot_bytes": self.hot_cache.held_bytes(),
                # The CPUs its hashing keeps off: where its clients' trainers run.
                "cpus_kept_free": sorted(shared_lanes().kept)}

    def _progress(self, sub: Submission) -> Dict[str, Any]:
        return {"run": sub.run, "rank": sub.rank, "step": sub.step,
                "bytes_total": sub.plan.nbytes,
                "bytes_written": sub.bytes_done,   # raw bytes, like bytes_total
                "accepted": sub.accepted, "started": sub.started}


def _pid_alive(pid: Any) -> bool:
    return isinstance(pid, int) and pid > 0 and psutil.pid_exists(pid)


def detached(root: str, options: Optional[Options] = None,
             timeout: float = 120.0) -> int:
    """``snapd serve --detach``: fork the daemon, wait until it serves (or exits), and
    return its verdict as this process's exit code: 0 serving, 2 another daemon
    serves the root, else the daemon's own failure code (its log says why).

    The daemon is our child only until we exit; then it belongs to init, so the
    client that started us waits for one short-lived process and leaves none behind.
    """
    pid = os.fork()
    if pid == 0:   # the daemon; never returns into the caller's code
        code = 1
        try:
            code = main(root, options)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if _serving(root):
            return 0
        time.sleep(0.02)
    logger.error("the daemon (pid %d) did not serve %s within %.0f s", pid, root, timeout)
    return 1


def _serving(root: str) -> bool:
    """Someone accepts on the root's socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            with p.socket_address(root) as address:
                sock.connect(address)
            return True
        except OSError:
            return False


def main(root: str, options: Optional[Options] = None) -> int:
    """``snapd serve``: serve ``root``; returns the process exit code."""
    stderrlog.set_format("snapd", LINE_FORMAT, DATE_FORMAT)   # this process is the daemon
    try:
        return Daemon(root, options).serve_forever()
    except AlreadyServing as e:
        logger.error("%s", e)
        return EXIT_ALREADY_SERVING
    except (SnapdError, OSError, ValueError) as e:   # cannot serve: say why, briefly
        logger.error("cannot serve %s: %s", root, e)
        return 1
