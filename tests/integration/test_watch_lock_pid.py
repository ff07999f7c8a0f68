"""``snapd watch``'s view of a daemon that holds the root's lock but does not answer:
a real process whose command line says ``snapd serve`` (tests/test_watch.py has the
rest of the view, in-process)."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil

from helpers import text_of, wait_until
from snapd import liveview as view


def test_collect_falls_back_to_the_lock_pid(root):
    """A daemon holding the lock but not answering: pid, CPU and RSS from psutil."""
    lock = os.path.join(root, ".snapd.lock")
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                               "snapd", "serve"])
    try:
        # Until the child has exec'd, its command line is still this process's.
        wait_until(lambda: "serve" in psutil.Process(holder.pid).cmdline(), 30,
                   "the holder to run its command")
        with open(lock, "w") as f:
            f.write(f"{holder.pid}\n")
        daemon = view.collect(root)["daemon"]   # asks the socket itself: none there
        assert daemon["running"] and not daemon["answering"]
        assert daemon["pid"] == holder.pid and daemon["rss"] > 0
        assert "not answering" in text_of(view.render(view.collect(root)))
        with open(lock, "w") as f:               # a pid that is no daemon's
            f.write(f"{os.getpid()}\n")
        assert not view.collect(root)["daemon"]["running"]
    finally:
        holder.kill()
        holder.wait()
