"""The daemon's socket: accept loop, one thread per connection, request dispatch.

docs/protocol.md is the contract. A connection starts with ``hello``; then each
request gets exactly one reply carrying its ``re``; ``committed``/``failed`` events
for the connection's submits arrive in between, whenever a write ends. Replies and
events share one send lock per connection, so frames never interleave, and a
``submit`` is queued while that lock is held with its ``accepted`` reply, so a
``committed`` event can never overtake the ``accepted`` it belongs to.

Anything that is not the protocol (not msgpack, not a map, an unknown op, a reply op
sent as a request, a request without ``id``) closes that connection; it never
reaches the daemon's other connections or its writes. A request that is well formed
but refused (a bad arena name, a busy slot, a descriptor outside its slot) gets an
``error`` reply and the connection stays open.

Who may connect: the socket is mode 0600 and the peer's uid (SO_PEERCRED) must
equal the daemon's (:func:`peer_allowed`).

Until its hello has arrived, a connection waits in the lobby (snapd/lobby.py), inside
the accept loop, with no thread of its own and a deadline. Only connections that said
hello get a thread and count against ``max_connections``, so idle sockets never lock
a trainer out: its hello, sent as it connects, always finds room.
"""

from __future__ import annotations

import os
import re
import selectors
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Protocol, Tuple

from snapd import protocol as p
from snapd.arena_map import MappedArena, check_arena_owner, hot_segment_name
from snapd.cpulanes import shared as shared_lanes
from snapd.lobby import LOBBY_SIZE, Lobby, Replay, Waiting
from snapd.errors import (DaemonUnavailable, InvalidOption, ProtocolError, ProtocolMismatch,
                          SnapdError)
from snapd.options import SUBMIT_OPTIONS, Options, check_shared
from snapd.signing import check_same_signer
from snapd.plan import SnapshotPlan, from_descriptor
from snapd.store import check_run_name

_CRED = struct.Struct("3i")   # struct ucred: pid, uid, gid
_OBJECT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,100}$")
OUTBOX_BYTES = 4 << 20   # replies and events a peer may leave unread before it is dropped


def peer_allowed(peer_uid: int, own_uid: int) -> bool:
    """Only the daemon's own user may hand it memory to write (no root exception)."""
    return peer_uid == own_uid


def peer_credentials(sock: socket.socket) -> Tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                        _CRED.size))


def submit_options(base: Options, given: Any) -> Options:
    """The daemon's options with the run's writer and retention settings applied.

    Keys outside SUBMIT_OPTIONS are ignored, so a newer client's extra settings do
    not break an older daemon; bad values are refused.
    """
    if not isinstance(given, dict):
        raise InvalidOption(f"submit options must be a map, got {type(given).__name__}",
                            field="options")
    chosen = {k: v for k, v in given.items() if k in SUBMIT_OPTIONS}
    for key in ("keep_last", "keep_every", "keep_best", "chunk_bytes"):
        value = chosen.get(key)
        if value is not None and (not isinstance(value, int) or value < 0):
            raise InvalidOption(f"submit option {key}={value!r}: use a non-negative int",
                                field=f"options.{key}")
    try:
        return base.replace(**chosen)
    except InvalidOption as e:   # it names the option: keep the class and the name
        raise InvalidOption(f"submit options refused: {e}",
                            field=f"options.{e.field}") from e
    except (TypeError, ValueError) as e:
        raise InvalidOption(f"submit options refused: {e}", field="options") from e


def check_descriptor(desc: Any, run: str, rank: int, step: int) -> None:
    """The descriptor must describe this submit, with plain object names."""
    if not isinstance(desc, dict) or not isinstance(desc.get("objects"), list):
        raise SnapdError("submit plan is not a plan descriptor (a map with objects)",
                         field="plan")
    if (desc.get("run"), desc.get("rank", 0), desc.get("step")) != (run, rank, step):
        raise SnapdError(f"submit plan is for run {desc.get('run')!r} rank "
                         f"{desc.get('rank', 0)} step {desc.get('step')}, but the submit "
                         f"says run {run!r} rank {rank} step {step}", field="plan")
    names = [o.get("name") if isinstance(o, dict) else None for o in desc["objects"]]
    for name in names:
        if not isinstance(name, str) or not _OBJECT_NAME.match(name) or ".." in name:
            raise SnapdError(f"submit plan: object name {name!r} is not a plain name",
                             field="plan.objects")
    if len(set(names)) != len(names):
        raise SnapdError("submit plan: two objects share a name", field="plan.objects")


def plan_over_slot(desc: Dict[str, Any], slot: memoryview) -> SnapshotPlan:
    """from_descriptor with every malformed-descriptor failure as a SnapdError."""
    try:
        return from_descriptor(desc, slot)
    except SnapdError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise SnapdError(f"submit plan descriptor is malformed: {e!r}",
                         field="plan") from e


@dataclass
class Submission:
    """One accepted snapshot: its plan over a slot the daemon owns until released."""

    conn: "Connection"
    arena: MappedArena
    slot: int
    view: memoryview
    plan: SnapshotPlan
    desc: Dict[str, Any]
    options: Options
    accepted: float = field(default_factory=time.time)
    started: Optional[float] = None
    bytes_done: int = 0   # raw bytes written so far (the writer's progress calls)
    _progress_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def advance(self, n: int) -> None:
        with self._progress_lock:  # called from several writer threads at once
            self.bytes_done += n

    run = property(lambda self: self.plan.run)
    rank = property(lambda self: self.plan.rank)
    step = property(lambda self: self.plan.step)

    def release(self) -> None:
        """Drop every view into the slot, then give the slot back to the client."""
        try:
            for obj in self.plan.objects:
                for tensor in obj.tensors:
                    tensor.data.release()
            self.view.release()
        except BufferError:
            pass   # a view still exported somewhere: the arena unmaps after the GC
        finally:
            self.arena.release(self.slot)


class Handler(Protocol):
    """What the server needs from the daemon (snapd/daemon.py implements it)."""

    root: str
    options: Options
    remote_url: str   # the remote it replicates to (redacted), "" for none
    signing_key_id: str   # the id of the key it signs with (snapd/signing.py), "" none

    def enqueue(self, sub: Submission) -> None: ...
    def status(self) -> Dict[str, Any]: ...
    def hot(self, run: str, rank: int) -> p.HotReply: ...
    def client_done(self, run: str, rank: int) -> None: ...
    def hot_release(self, run: str, rank: int) -> None: ...
    def client_left(self, run: str, rank: int, clean: bool) -> None: ...
    def stop(self) -> None: ...
    def log(self, message: str) -> None: ...


class Connection:
    """One client connection: its identity, its arenas, and its outbox.

    Nothing the daemon sends ever blocks the thread that sends it: replies and
    events are queued here and written by the connection's own sender thread, with a
    send timeout. A peer that leaves more than ``OUTBOX_BYTES`` unread, or reads
    nothing for ``peer_timeout`` seconds, is dropped; a writer thread never waits on
    it, and the snapshots it submitted still finish.
    """

    def __init__(self, sock: socket.socket, handler: Handler, peer_pid: int,
                 greeting: Optional[bytes] = None) -> None:
        self.sock = sock
        self._greeting = greeting   # the first frame, when the lobby has read it
        self.handler = handler
        self.peer_pid = peer_pid   # SO_PEERCRED's, not what hello claims
        self.pid, self.run, self.rank = peer_pid, "", 0
        self.arenas: Dict[Tuple[str, int], MappedArena] = {}
        self.order_lock = threading.Lock()   # a submit's accepted before its events
        self.closed = False
        self.finished = False   # the client said bye: everything resolved, clean exit
        self.dropped: Optional[str] = None   # why the daemon hung up on the peer
        self._outbox: Deque[bytes] = deque()
        self._outbox_bytes = 0
        self._out_cond = threading.Condition()
        self._timeout = handler.options.peer_timeout
        self._requests: Dict[type, Callable[[Any, int], Optional[Any]]] = {
            p.Hello: self._on_hello, p.Attach: self._on_attach, p.Submit: self._on_submit,
            p.Status: lambda m, r: p.StatusReply(self.handler.status()),
            p.HotGet: self._on_hot, p.HotRelease: self._on_hot_release,
            p.Bye: self._on_bye, p.Stop: self._on_stop,
            p.Ping: lambda m, r: p.Pong(os.getpid())}
        _set_timeout(sock, socket.SO_SNDTIMEO, self._timeout)
        _set_timeout(sock, socket.SO_RCVTIMEO, self._timeout)
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"snapd-send-{peer_pid}")
        self._sender.start()

    # --- sending ------------------------------------------------------------------

    def _queue(self, message: Any, **envelope: int) -> bool:
        """Queue a frame for the sender; False (and the peer dropped) if it is not
        reading, or gone."""
        frame = p.encode(message, **envelope)
        with self._out_cond:
            if self.closed or self.dropped:
                return False
            if self._outbox_bytes + len(frame) > OUTBOX_BYTES:
                overflow = True
            else:
                overflow = False
                self._outbox.append(frame)
                self._outbox_bytes += len(frame)
                self._out_cond.notify()
        if overflow:
            self.drop(f"left over {OUTBOX_BYTES} bytes of replies unread")
        return not overflow

    def _send_loop(self) -> None:
        """Send queued frames in order; after close(), what is left (a last error
        reply), then stop."""
        while True:
            with self._out_cond:
                self._out_cond.wait_for(lambda: self._outbox or self.closed or self.dropped)
                if self.dropped or not self._outbox:
                    return
                frame = self._outbox.popleft()
            try:
                self.sock.sendall(frame)
            except BlockingIOError:   # SO_SNDTIMEO: the peer read nothing meanwhile
                self.drop(f"read none of its replies for {self._timeout} s")
                return
            except OSError:
                self.drop("cannot be written to")
                return
            with self._out_cond:   # counted until sent, so shutdown() can wait for it
                self._outbox_bytes -= len(frame)
                self._out_cond.notify_all()

    def drop(self, why: str) -> None:
        """Hang up on a peer that does not play its part; serve() then closes."""
        with self._out_cond:
            if self.dropped or self.closed:
                return
            self.dropped = why
            self._out_cond.notify_all()
        self.shutdown()

    def send_event(self, message: Any) -> bool:
        """Queue a committed/failed event; False when the client is gone."""
        with self.order_lock:
            return self._queue(message)

    def reply(self, message: Any, rid: int) -> None:
        self._queue(message, re=rid)

    # --- the loop -----------------------------------------------------------------

    def serve(self) -> None:
        """Read and answer requests until the peer leaves or breaks the protocol."""
        why = "disconnected"
        try:
            self._dispatch(self._next_frame(first=True), first=True)
            while True:
                self._dispatch(self._next_frame())
        except EOFError:
            pass
        except ProtocolError as e:
            why = f"closed for a protocol error: {e}"
        except BlockingIOError:
            why = f"closed: a frame (or hello) took over {self._timeout} s to arrive"
        except OSError as e:
            why = f"connection error: {e}"
        except Exception as e:   # a bug here must cost one connection, not the daemon
            why = f"closed after an internal error: {e!r}"
        finally:
            self.close()
            why = f"dropped: it {self.dropped}" if self.dropped else why
            if self.run or why != "disconnected":   # tools (status, watch) come and go
                self.handler.log(f"client pid {self.pid} run {self.run!r} rank "
                                 f"{self.rank} {why}")
            if self.run:
                shared_lanes().keep_free((self.run, self.rank), None)
                self.handler.client_left(self.run, self.rank, clean=self.finished)

    def _next_frame(self, first: bool = False) -> Dict[str, Any]:
        """The next frame. Between frames a client may be quiet for hours; a started
        frame, and the first one (hello), must arrive within ``peer_timeout``; a
        first frame the lobby has read already is decoded from its bytes."""
        if first and self._greeting is not None:
            greeting, self._greeting = self._greeting, None
            return p.recv(Replay(greeting))
        while True:
            try:
                if not self.sock.recv(1, socket.MSG_PEEK):
                    raise EOFError("peer closed the connection")
                break
            except BlockingIOError:
                if first:
                    raise
        return p.recv(self.sock)

    def _dispatch(self, data: Dict[str, Any], first: bool = False) -> None:
        message = p.from_wire(data)
        rid = data.get("id")
        if not isinstance(rid, int) or isinstance(rid, bool):
            raise ProtocolError(f"{data['op']} request without an int id", field="id")
        if first and not isinstance(message, p.Hello):
            raise ProtocolError(f"first message is {data['op']}, not hello", field="op")
        handle = self._requests.get(type(message))
        if handle is None:
            raise ProtocolError(f"{data['op']} is not a request", field="op")
        try:
            answer = handle(message, rid)
        except ProtocolError:
            raise   # closes the connection; never an error reply
        except SnapdError as e:   # refused: the peer gets the error with its fields
            answer = p.Error.of(e)
        if answer is not None:
            self.reply(answer, rid)

    # --- requests -----------------------------------------------------------------

    def _on_hello(self, m: p.Hello, rid: int) -> Any:
        if m.protocol != p.PROTOCOL_VERSION:
            # A kind of its own, so that a client of any version can tell it apart;
            # replied, then the connection closes (a ProtocolError is never replied).
            mismatch = ProtocolMismatch(
                f"client speaks protocol {m.protocol!r}, this daemon "
                f"{p.PROTOCOL_VERSION}; run the same snapd version on both sides",
                path=self.handler.root, field="protocol")
            self.reply(p.Error.of(mismatch), rid)
            raise ProtocolError(f"protocol mismatch ({m.protocol!r})",
                                field="protocol") from mismatch
        if not isinstance(m.pid, int) or isinstance(m.pid, bool):
            raise ProtocolError(f"hello pid {m.pid!r} is not an int", field="pid")
        if m.run != "":   # "" is a tool (status, watch); a run is checked like any
            _check_run(m.run, m.rank)
            # One value of each daemon-wide option for every client: OptionMismatch.
            check_shared(self.handler.options, m.options, self.handler.root)
            if m.signing_key_id is not None:   # one signing key too, by its id
                check_same_signer(self.handler.signing_key_id, m.signing_key_id,
                                  self.handler.root)
        self.pid, self.run, self.rank = m.pid, m.run, m.rank
        if m.run:
            self.handler.log(f"client pid {m.pid} run {m.run!r} rank {m.rank} connected")
        return p.Welcome(p.PROTOCOL_VERSION, os.getpid(), self.handler.root,
                         getattr(self.handler, "remote_url", ""))

    def _on_attach(self, m: p.Attach, rid: int) -> Any:
        _check_run(m.run, m.rank)
        arena = MappedArena(check_arena_owner(m.shm, self.peer_pid), m.size, m.slots)
        try:
            if m.hot is True and m.slots >= 2:
                # A hot copy is read by name after its trainer died: the daemon's
                # name, which the daemon unlinks when it lets go (or the next daemon,
                # if this one is SIGKILLed: see HotCache.reclaim_orphans).
                arena.take_name(hot_segment_name(m.run, m.rank))
                arena.hot = True
        except SnapdError as e:   # no hot copy then; the snapshots go on
            self.handler.log(f"run {m.run!r} rank {m.rank}: no hot copy: {e}")
        if not arena.hot:
            arena.unlink_name()   # mapped on both sides: no death can leak it now
        old = self.arenas.get((m.run, m.rank))
        self.arenas[(m.run, m.rank)] = arena
        if old is not None:   # replaced: unmap once its submitted slots are done
            old.retire(unlink=False)
        return p.Ok()

    def _on_submit(self, m: p.Submit, rid: int) -> Any:
        _check_run(m.run, m.rank)
        if not isinstance(m.step, int) or isinstance(m.step, bool) or m.step < 0:
            raise SnapdError(f"submit step {m.step!r}: a non-negative int", field="step")
        arena = self.arenas.get((m.run, m.rank))
        if arena is None:
            raise SnapdError(f"no arena attached for run {m.run!r} rank {m.rank}; "
                             "attach one before submit", field="slot")
        if m.cpu is not None and (not isinstance(m.cpu, int) or isinstance(m.cpu, bool)
                                  or m.cpu < 0):
            raise SnapdError(f"submit cpu {m.cpu!r}: the CPU the trainer runs on, an "
                             "int >= 0, or nil", field="cpu")
        check_descriptor(m.plan, m.run, m.rank, m.step)
        options = submit_options(self.handler.options, m.options)
        arena.acquire(m.slot)
        view = arena.slot_view(m.slot)
        try:
            plan = plan_over_slot(m.plan, view)
        except BaseException:
            view.release()
            arena.release(m.slot)
            raise
        sub = Submission(self, arena, m.slot, view, plan, m.plan, options)
        shared_lanes().keep_free((m.run, m.rank), m.cpu)
        try:
            # Queue and reply under the order lock: the committed event (queued
            # under the same lock) cannot overtake this accepted reply.
            with self.order_lock:
                self.handler.enqueue(sub)
                self._queue(p.Accepted(m.step), re=rid)
        except BaseException:
            sub.release()
            raise
        return None

    def _on_hot(self, m: p.HotGet, rid: int) -> Any:
        _check_run(m.run, m.rank)
        return self.handler.hot(m.run, m.rank)

    def _on_hot_release(self, m: p.HotRelease, rid: int) -> Any:
        _check_run(m.run, m.rank)
        self.handler.hot_release(m.run, m.rank)
        return p.Ok()

    def _on_bye(self, m: p.Bye, rid: int) -> Any:
        self.finished = True
        if self.run:
            self.handler.client_done(self.run, self.rank)
        return p.Ok()

    def _on_stop(self, m: p.Stop, rid: int) -> Any:
        # The ok is queued before the daemon is woken: the drain's close of every
        # connection flushes what is queued, so the asker always hears it.
        self.reply(p.Ok(), rid)
        self.handler.log(f"pid {self.pid} asked the daemon to stop (snapd stop)")
        self.handler.stop()
        return None

    def close(self) -> None:
        """Stop talking; arenas unmap once their submitted slots are done."""
        with self._out_cond:
            if self.closed:
                return
            self.closed = True
            self._out_cond.notify_all()
        self._sender.join()   # a last reply goes out; bounded by the send timeout
        try:
            self.sock.close()
        except OSError:
            pass
        for arena in self.arenas.values():
            arena.retire(unlink=True)

    def shutdown(self, flush_timeout: float = 5.0) -> None:
        """Wake the connection's thread (recv returns EOF) so that it exits, once the
        events already queued (a drain's last ``committed``) have gone out, or the
        peer has had ``flush_timeout`` seconds to read them."""
        with self._out_cond:
            self._out_cond.wait_for(lambda: self._outbox_bytes == 0 or self.dropped,
                                    timeout=flush_timeout)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _set_timeout(sock: socket.socket, option: int, seconds: float) -> None:
    """SO_SNDTIMEO/SO_RCVTIMEO: a blocking call gives up (EAGAIN) after ``seconds``."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, option,
                    struct.pack("ll", whole, int((seconds - whole) * 1e6)))


def _until(*deadlines: Optional[float]) -> Optional[float]:
    """Seconds until the earliest of the deadlines given (None: no deadline at all)."""
    given = [d for d in deadlines if d is not None]
    return max(0.0, min(given) - time.monotonic()) if given else None


def _check_run(run: Any, rank: Any) -> None:
    try:
        check_run_name(run)
    except ValueError as e:
        raise SnapdError(str(e), field="run") from e
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise SnapdError(f"rank {rank!r}: a non-negative int", field="rank")


class Server:
    """The listening socket and its connections."""

    def __init__(self, root: str, handler: Handler) -> None:
        self.root = root
        self.path = os.path.join(root, p.SOCKET_NAME)
        self.handler = handler
        self.connections: List[Connection] = []
        self._threads: List[threading.Thread] = []
        self._lock = threading.Lock()
        self._listener: Optional[socket.socket] = None
        self._identity: Optional[tuple] = None   # (st_dev, st_ino) of our socket file

    def bind(self) -> None:
        """Listen on <root>/.snapd.sock, mode 0600 (the caller holds the root lock)."""
        try:   # a socket left by a dead daemon: we hold the lock, so it is stale
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)   # never exists with looser permissions, even briefly
        try:
            with p.socket_address(self.root) as address:
                listener.bind(address)
                # At once: a client that finds the socket file takes it as listening.
                listener.listen(64)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        st = os.stat(self.path)
        self._identity = (st.st_dev, st.st_ino)
        self._listener = listener

    def owns_socket(self) -> bool:
        """The socket file at our path is still the one we bound: not removed with
        its root, nor replaced by another daemon's."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._identity

    def serve(self, wake_fd: int, *, check_every: Optional[float] = None,
              keep_serving: Callable[[], bool] = lambda: True) -> None:
        """Accept connections until ``wake_fd`` becomes readable, or until
        ``keep_serving()``, asked every ``check_every`` seconds, says no."""
        assert self._listener is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(wake_fd, selectors.EVENT_READ)
            lobby = Lobby(sel, LOBBY_SIZE, self.handler.options.hello_timeout,
                          self.handler.log)
            next_check = None if check_every is None else time.monotonic() + check_every
            try:
                while True:
                    ready = sel.select(_until(next_check, lobby.next_deadline()))
                    woken = {key.fileobj for key, _ in ready}
                    if wake_fd in woken:
                        return
                    for key, _ in ready:
                        if isinstance(key.data, Waiting):
                            self._greet(lobby, key.data)
                    if self._listener in woken:
                        self._accept(lobby)
                    lobby.expire(time.monotonic())
                    if next_check is not None and time.monotonic() >= next_check:
                        if not keep_serving():
                            return
                        next_check = time.monotonic() + check_every
            finally:
                lobby.close_all()

    def _accept(self, lobby: Lobby) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        try:
            pid, uid, _gid = peer_credentials(sock)
        except OSError:
            sock.close()
            return
        if not peer_allowed(uid, os.getuid()):
            self.handler.log(f"refused a connection from pid {pid} uid {uid}")
            sock.close()
            return
        self._greet(lobby, lobby.admit(sock, pid))   # its hello is often there already

    def _greet(self, lobby: Lobby, waiting: Waiting) -> None:
        """Read what has come of a waiting connection's first frame; once it is whole,
        the connection leaves the lobby for a thread of its own, if the cap has room."""
        try:
            if not waiting.read():
                return
        except EOFError:   # a probe, or a tool that came and went: nothing to say
            lobby.close(waiting, None)
            return
        except ProtocolError as e:
            lobby.close(waiting, f"closed for a protocol error: {e}")
            return
        except OSError as e:
            lobby.close(waiting, f"connection error: {e}")
            return
        sock = lobby.leave(waiting)
        if len(self.live_connections()) >= self.handler.options.max_connections:
            self._refuse(sock, waiting.pid)
            return
        self._start(Connection(sock, self.handler, waiting.pid,
                               greeting=bytes(waiting.received)))

    def _start(self, conn: Connection) -> None:
        pid = conn.peer_pid
        thread = threading.Thread(target=conn.serve, name=f"snapd-conn-{pid}", daemon=True)
        with self._lock:
            self.connections = [c for c in self.connections if not c.closed] + [conn]
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _refuse(self, sock: socket.socket, pid: int) -> None:
        """One error frame, never waited on, then close: the cap on connections that
        said hello holds their threads bounded whatever the peers do."""
        cap = self.handler.options.max_connections
        frame = p.encode(p.Error.of(DaemonUnavailable(
            f"the daemon serving {self.root} already has {cap} connections "
            f"(max_connections, SNAPD_MAX_CONNECTIONS); close idle clients or raise it",
            path=self.path, field="max_connections")))
        try:
            sock.send(frame, socket.MSG_DONTWAIT)
        except OSError:
            pass
        sock.close()
        self.handler.log(f"refused a connection from pid {pid}: {cap} connections open")

    def stop_accepting(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def live_connections(self) -> List[Connection]:
        with self._lock:
            return [c for c in self.connections if not c.closed]

    def close_connections(self, timeout: float = 5.0) -> None:
        for conn in self.live_connections():
            conn.shutdown()
        with self._lock:
            threads = list(self._threads)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def unlink_socket(self) -> None:
        """Remove our socket file; never one that another daemon bound since."""
        if not self.owns_socket():
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
