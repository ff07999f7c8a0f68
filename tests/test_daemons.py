"""Which processes count as daemons, the idle limit a daemon applies, and the
``snapd status --daemons`` table; the processes themselves are in
tests/integration/test_daemon_lifetime.py."""

from __future__ import annotations

import io
import os

import pytest
from rich.console import Console

from snapd.commands.status import render_daemons
from snapd.daemon import Daemon
from snapd.daemons import served_root
from snapd.errors import InvalidOption
from snapd.options import Options


@pytest.mark.parametrize("cmdline, root", [
    (["/usr/bin/python3", "-P", "-m", "snapd", "serve", "--root", "/r", "--detach"], "/r"),
    (["/venv/bin/python", "/venv/bin/snapd", "serve", "--root=ckpt"], "ckpt"),
    (["/venv/bin/snapd", "serve", "--detach", "--root", "/r"], "/r"),
    (["python", "-m", "snapd", "stop", "/r"], None),          # another subcommand
    (["python", "train.py", "serve", "--root", "/r"], None),  # another program
    (["python", "-m", "snapd", "serve"], None),               # no root given
    (["python", "-c", "pass", "snapd", "serve", "--root", "/r"], None),
])
def test_served_root_reads_only_snapd_serve(cmdline, root):
    assert served_root(cmdline) == root


def test_idle_bare_exit_seconds_is_validated_naming_the_field():
    with pytest.raises(InvalidOption) as info:
        Options(idle_bare_exit_seconds=-1)
    assert info.value.field == "idle_bare_exit_seconds"
    assert "idle_bare_exit_seconds=-1: zero or more" in str(info.value)
    assert Options.resolve(environ={"SNAPD_IDLE_BARE_EXIT_SECONDS": "5"}) \
        .idle_bare_exit_seconds == 5.0


@pytest.fixture
def daemon(tmp_path):
    """daemon(**options) -> a Daemon of tmp_path, never served; its wake pipe closed
    after the test."""
    made = []

    def make(**options) -> Daemon:
        made.append(Daemon(str(tmp_path), Options(**options)))
        return made[-1]

    yield make
    for d in made:
        os.close(d._wake_r)
        os.close(d._wake_w)


class _Uploader:
    """The uploader as the idle exit sees it: busy now, or with work pending."""

    def __init__(self, busy: bool, idle: bool) -> None:
        self._busy, self._idle = busy, idle

    def busy(self) -> bool:
        return self._busy

    def idle(self) -> bool:
        return self._idle

    def status(self) -> dict:
        return {"url": "file:///remote", "runs": {}, "last_error": None}


@pytest.mark.parametrize("idle_exit, bare, keeps_nothing, limit", [
    (600.0, 60.0, True, 60.0),     # keeps nothing: the shorter limit
    (600.0, 60.0, False, 600.0),   # holds a hot copy (or an upload): today's rule
    (30.0, 60.0, True, 30.0),      # the shorter of the two
    (600.0, 0.0, True, 600.0),     # bare 0: idle_exit_seconds alone
    (0.0, 60.0, True, 0.0),        # started by hand: never, whatever it keeps
])
def test_idle_limit(daemon, idle_exit, bare, keeps_nothing, limit):
    d = daemon(idle_exit_seconds=idle_exit, idle_bare_exit_seconds=bare)
    assert d._idle_limit(keeps_nothing) == limit


def test_a_pending_upload_keeps_the_longer_limit_and_a_running_one_the_daemon(daemon):
    d = daemon(idle_exit_seconds=600.0, idle_bare_exit_seconds=60.0)
    assert d._keeps_nothing() and not d._busy()
    assert d.status()["idle_limit_seconds"] == 60.0
    d.uploader = _Uploader(busy=False, idle=False)   # waiting to retry
    assert not d._keeps_nothing() and not d._busy()
    assert d.status()["idle_limit_seconds"] == 600.0
    d.uploader = _Uploader(busy=True, idle=False)    # uploading now
    assert d._busy() and d.idle_seconds() == 0.0


def test_daemons_table_says_when_each_exits():
    base = {"pid": 41, "rss": 50 << 20, "started": 0.0, "answering": True,
            "stopping": False, "idle_seconds": 12.0, "clients": 0, "hot_bytes": 0}
    rows = [{**base, "root": "/ckpt/bare", "idle_limit_seconds": 60.0},
            {**base, "root": "/ckpt/hand", "idle_limit_seconds": 0.0},
            {**base, "root": "/ckpt/hot", "idle_limit_seconds": 600.0,
             "hot_bytes": 3 << 20},
            {**base, "root": "/ckpt/stopping", "stopping": True},
            {**base, "root": "/ckpt/hung", "answering": False, "idle_seconds": None,
             "idle_limit_seconds": None, "clients": None, "hot_bytes": None}]
    out = io.StringIO()
    Console(file=out, width=120, force_terminal=False, color_system=None) \
        .print(render_daemons(rows))
    lines = {line.split()[1]: line for line in out.getvalue().splitlines()
             if "/ckpt/" in line}
    assert "after 1.0m idle" in lines["/ckpt/bare"] and "12s" in lines["/ckpt/bare"]
    assert "never (idle exit off)" in lines["/ckpt/hand"]
    assert "after 10.0m idle" in lines["/ckpt/hot"] and "3.0 MiB" in lines["/ckpt/hot"]
    assert "stopping" in lines["/ckpt/stopping"]
    assert "not answering" in lines["/ckpt/hung"] and "50.0 MiB" in lines["/ckpt/hung"]
