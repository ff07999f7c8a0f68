"""`snapd serve --root ROOT --remote URL` whose remote commits wait for a gate file.

Usage: python gated_upload_daemon.py ROOT GATE URL

Every file of an upload goes up; then, before the remote commit record is written,
the daemon creates GATE.waiting and waits until GATE exists. A test kills it there:
a crash between the last file and the record, on any machine, whatever the upload's
speed. The substitution is of RemoteRoot.write_record in this process only; the
product path is unchanged.
"""

import os
import sys
import time

from snapd import daemon as snapd_daemon, stderrlog
from snapd.options import Options
from snapd.remote.layout import RemoteRoot

root, gate, url = sys.argv[1], sys.argv[2], sys.argv[3]
write_record = RemoteRoot.write_record


def gated_write_record(self, run, name, record, signer=None):
    with open(gate + ".waiting", "w"):
        pass   # tells the test every file is up
    while not os.path.exists(gate):
        time.sleep(0.02)   # no event to wait on across processes: poll the gate file
    return write_record(self, run, name, record, signer)


RemoteRoot.write_record = gated_write_record
stderrlog.set_format("snapd", snapd_daemon.LINE_FORMAT, snapd_daemon.DATE_FORMAT)
options = Options.resolve({"idle_exit_seconds": 0.0, "remote": url})
sys.exit(snapd_daemon.Daemon(root, options).serve_forever())
