"""`snapd serve --root ROOT [--idle-exit S]` whose writes wait for a gate file.

Usage: python gated_daemon.py ROOT GATE [IDLE_EXIT_SECONDS [RANKS [STEPS]]]

RANKS (comma-separated, default every rank): only these ranks' writes wait; the
others go through, so a multi-rank snapshot can be held with some parts durable.
STEPS (comma-separated, default every step): only the snapshots of these steps wait,
so the earlier ones of a run commit.

A snapshot stays in flight exactly until the test creates GATE, on any machine: the
tests that need a write in flight (drain on stop, no idle exit while writing) then
do not depend on how long a large compressed write happens to take. The substitution
is the daemon's own seam (``Daemon(writer=...)``); the product path is unchanged.
"""

import os
import sys
import time

from snapd import daemon as snapd_daemon, stderrlog
from snapd.options import Options
from snapd.writer import write_snapshot

root, gate = sys.argv[1], sys.argv[2]
idle = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
gated_ranks = {int(r) for r in sys.argv[4].split(",")} if len(sys.argv) > 4 else None
gated_steps = {int(s) for s in sys.argv[5].split(",")} if len(sys.argv) > 5 else None


def gated_writer(store, plan, opts, **kwargs):
    if (gated_ranks is not None and plan.rank not in gated_ranks) or \
            (gated_steps is not None and plan.step not in gated_steps):
        return write_snapshot(store, plan, opts, **kwargs)
    with open(gate + ".waiting", "w"):
        pass   # tells the test a write is in flight
    while not os.path.exists(gate):
        time.sleep(0.02)   # no event to wait on across processes: poll the gate file
    return write_snapshot(store, plan, opts, **kwargs)


stderrlog.set_format("snapd", snapd_daemon.LINE_FORMAT, snapd_daemon.DATE_FORMAT)
options = Options.resolve({"idle_exit_seconds": idle})
sys.exit(snapd_daemon.Daemon(root, options, writer=gated_writer).serve_forever())
