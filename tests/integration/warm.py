"""Trainer processes without an ``import torch`` each: a warm parent imports torch,
numpy and snapd_client once, then forks one child per script it is asked to run.

Run as ``python warm.py [MODULE ...]`` (modules imported besides PRELOAD), it reads requests from stdin, one JSON line each
(``{"script", "args", "env", "stdout", "stderr", "cwd"}``), forks, and answers
``{"pid": N}``; when a child exits it writes ``{"exited": N, "code": C}`` (C as
``Popen.returncode``: -9 for a SIGKILL). A child is a fresh process: nothing has run
in the parent but those imports (no torch op, so no thread pool to inherit), and it
runs the script as ``__main__`` with its own argv, environment, folder and output
files, and exits as ``python script args...`` would. What it keeps of the parent is
what the interpreter reads once at start, PYTHONHASHSEED's hash seed above all, and
the state of the RNG streams nobody seeded (python's ``random`` and numpy's global
one, seeded at import): siblings share them. Tests that compare a resumed run with
the run it resumes take the two from different warm parents (:class:`Warm` is one
parent), so that they differ in both as separate interpreters do; a test about
processes that never seed a stream keeps separate interpreters
(test_cli_diff_runs.py).

:class:`Warm` is the test's side: ``start(script, args, env, stdout)`` returns a
:class:`WarmProcess` with ``pid``, ``wait(timeout)``, ``poll()``, ``kill()`` and
``returncode``, the part of ``subprocess.Popen`` the tests use; ``run(script, args)``
runs one to its end, as ``subprocess.run(capture_output=True, text=True)``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, NamedTuple, Optional

# torch._dynamo too: torch imports it when the first optimizer is built (about 2 s here)
PRELOAD = ("torch", "numpy", "xxhash", "torch.utils.data", "torch._dynamo", "snapd_client")


class WarmProcess:
    """One forked child of a :class:`Warm` parent, seen like a ``Popen``."""

    def __init__(self, warm: "Warm", pid: int) -> None:
        self.warm, self.pid = warm, pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        self.warm._read_exits(0.0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"warm child {self.pid}", timeout)
            self.warm._read_exits(left)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass   # exited already; its exit line is on the way


class WarmRun(NamedTuple):
    """A child run to its end by :meth:`Warm.run`."""
    pid: int
    returncode: int
    stdout: str
    stderr: str


class Warm:
    """A warm parent process (this file run as a script) and its children."""

    def __init__(self, preload: tuple = ()) -> None:
        """``preload``: modules the parent imports besides PRELOAD (a framework the
        children all import: ``transformers.trainer``)."""
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *preload],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.children: Dict[int, WarmProcess] = {}
        self._buffer = b""

    def start(self, script: str, args: List[str], env: Optional[Dict[str, str]],
              stdout: str, stderr: Optional[str] = None,
              cwd: Optional[str] = None) -> WarmProcess:
        """Run ``script args`` in a forked child, its output appended to ``stdout``
        (and its errors to ``stderr``, if given); ``env`` None: this process's
        environment now, as ``Popen(env=None)``; ``cwd`` None: this one's folder."""
        request = {"script": os.path.abspath(script), "args": list(args),
                   "env": dict(os.environ if env is None else env),
                   "stdout": str(stdout), "stderr": str(stderr or stdout),
                   "cwd": os.path.abspath(cwd or os.getcwd())}
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        while True:
            reply = self._next_line(120.0)
            if "pid" in reply:
                child = self.children[reply["pid"]] = WarmProcess(self, reply["pid"])
                return child
            self._exited(reply)

    def run(self, script: str, args: List[str], env: Optional[Dict[str, str]] = None,
            cwd: Optional[str] = None, timeout: float = 120.0) -> "WarmRun":
        """``script args`` to its end (killed past ``timeout``, which then raises
        ``TimeoutExpired``): its pid, exit status, stdout and stderr."""
        with tempfile.TemporaryDirectory(prefix="sdwarm-") as outputs:
            out, err = os.path.join(outputs, "stdout"), os.path.join(outputs, "stderr")
            proc = self.start(script, args, env, out, err, cwd)
            try:
                proc.wait(timeout)
            finally:
                proc.kill()
                proc.wait()
            with open(out) as f_out, open(err) as f_err:
                return WarmRun(proc.pid, proc.returncode, f_out.read(), f_err.read())

    def close(self) -> None:
        """Kill the children still running, then the parent."""
        for child in self.children.values():
            child.kill()
        self.proc.kill()
        self.proc.wait()

    def _read_exits(self, timeout: Optional[float]) -> None:
        """Take in the exit lines that come within ``timeout`` (at least one if any)."""
        try:
            self._exited(self._next_line(timeout))
        except subprocess.TimeoutExpired:
            return
        while b"\n" in self._buffer:
            self._exited(self._next_line(0.0))

    def _exited(self, reply: dict) -> None:
        child = self.children.get(reply["exited"])
        if child is not None:
            child.returncode = reply["code"]

    def _next_line(self, timeout: Optional[float]) -> dict:
        out = self.proc.stdout.fileno()
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([out], [], [], left)[0]:
                raise subprocess.TimeoutExpired("warm parent", timeout)
            chunk = os.read(out, 65536)
            assert chunk, f"the warm parent exited ({self.proc.poll()})"
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)


# --- the warm parent ------------------------------------------------------------------

def _serve(preload: List[str]) -> None:
    import gc
    import importlib
    for name in (*PRELOAD, *preload):
        importlib.import_module(name)
    # What the imports made lives as long as the parent: out of the collector's sight,
    # a child's collections (and its exit's) never write to those pages, which fork
    # shares until written. Without it a child that runs nothing costs ~1.5 s of CPU.
    gc.freeze()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)   # wakes the select below
    requests = b""
    while True:
        ready = select.select([0, wake_r], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
            _report_exits()
        if 0 in ready:
            chunk = os.read(0, 1 << 20)
            if not chunk:
                return   # the test closed its end
            requests += chunk
            while b"\n" in requests:
                line, requests = requests.split(b"\n", 1)
                pid = _fork_child(json.loads(line), (wake_r, wake_w))
                _answer({"pid": pid})
        _report_exits()


def _report_exits() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _answer({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _answer(reply: dict) -> None:
    os.write(1, json.dumps(reply).encode() + b"\n")


def _fork_child(request: dict, wake: tuple) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:
        _become_child(request, wake)
    except BaseException:
        import traceback
        traceback.print_exc()
        os._exit(1)   # never back into the parent's loop
    try:
        _run_script(request["script"], request["args"])
    except SystemExit:
        raise
    except BaseException:
        sys.excepthook(*sys.exc_info())   # what the interpreter prints, exit status 1
        raise SystemExit(1) from None
    # The script's end: out of the parent's loop, the interpreter exits as after
    # ``python script`` (atexit handlers, output flushed), status 0 or the SystemExit's.
    raise SystemExit(0)


def _become_child(request: dict, wake: tuple) -> None:
    """The parent's wiring is not the child's: default signals, no pipes to the test,
    the request's output files, folder and environment."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in wake:
        os.close(fd)
    _redirect(os.devnull, 0, os.O_RDONLY)
    _redirect(request["stdout"], 1, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    _redirect(request["stderr"], 2, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])


def _redirect(path: str, fd: int, flags: int) -> None:
    opened = os.open(path, flags, 0o644)
    os.dup2(opened, fd)
    os.close(opened)


def _run_script(script: str, args: List[str]) -> None:
    """As ``python script args``: its folder first on sys.path (where this file's
    was), then its PYTHONPATH, its argv, run as __main__."""
    import runpy
    sys.argv = [script, *args]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p and p not in sys.path]
    sys.path[0:1] = [os.path.dirname(script), *extra]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    _serve(sys.argv[1:])
