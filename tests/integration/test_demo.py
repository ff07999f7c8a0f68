"""The README's first command, ``python scripts/demo.py``, as a reader sees it: the
story ends IDENTICAL, and its output holds no traceback. The trainer it SIGKILLs has
DataLoader workers that lose their parent mid-handoff now and then; what torch would
print about it must not stand in the middle of the story (scripts/demo.py,
``quiet_when_orphaned``), while the kill itself is told in the demo's own words."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from helpers import stop_daemons_under

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "scripts", "demo.py")


def test_the_demo_tells_the_whole_story_without_a_traceback(short_root):
    keep = os.path.join(short_root, "demo")
    proc = subprocess.Popen([sys.executable, DEMO, "--keep", keep], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:   # past the bound: the demo and its trainers (one session), then its daemon
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        stop_daemons_under(short_root)
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out
    assert "   -- trainer SIGKILLed after step 27 (exit -9); its DataLoader workers, " \
           "orphaned, exit on their own\n" in out
    assert "replay check of the recomputed steps 20..27: match (7 steps compared with " \
           "the log)" in out
    assert out.splitlines()[-1].startswith("IDENTICAL: the resumed run is the same run (")
