"""A trainer that starts on a full disk: run by test_full_disk_start.py inside a private
mount namespace, where each directory named on the command line is a small tmpfs of
its own (mounted by the test's command before this script runs).

For each ``<case>=<mount>`` argument it fills ``<mount>`` to its last byte at the
point the case names, meets the error there, frees the space and starts again; it
prints one JSON line: case -> what was raised, and what the retry found.

- ``client``: the disk is full before ``Client()``.
- ``fresh``: ``Client()`` made, the disk full before ``restore()`` of a new run.
- ``resume``: a snapshot at step 2 taken, then a new Client; the disk full before
  its ``restore()``, whose resume record starts a new log segment.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from snapd_client import Client

# tests/: its helpers (the script runs from tests/integration, in a mount namespace)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import fill  # noqa: E402

RUN = "r"


def raised(action) -> dict:
    try:
        action()
    except Exception as e:   # reported, for the test to compare field by field
        return {"class": type(e).__name__, "module": type(e).__module__,
                "message": str(e), "path": getattr(e, "path", None),
                "field": getattr(e, "field", None), "errno": getattr(e, "errno", None),
                "is_oserror": isinstance(e, OSError)}
    return {"class": None}


def tracked(client: Client) -> Client:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return client.track(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1))


def case_client(mount: str) -> dict:
    root = os.path.join(mount, "root")
    filler = fill(mount)
    out = raised(lambda: Client(root, RUN))
    os.unlink(filler)
    client = Client(root, RUN, daemon=False)   # the failed one holds no lock
    out["retry_step"] = tracked(client).restore()
    client.close()
    return out


def case_fresh(mount: str) -> dict:
    root = os.path.join(mount, "root")
    client = tracked(Client(root, RUN, daemon=False))
    filler = fill(mount)
    out = raised(client.restore)
    os.unlink(filler)
    out["retry_step"] = client.restore()
    client.close()
    return out


def case_resume(mount: str) -> dict:
    root = os.path.join(mount, "root")
    first = tracked(Client(root, RUN, daemon=False, min_free_bytes=0))
    first.restore()
    first.log(1, loss=0.5)
    first.log(2, loss=0.25)
    first.snapshot(2).wait()
    first.close()
    # The segment has reached its size (as a long run's does at 64 MiB): the resume
    # record starts a new one, whose header needs a block the full disk lacks.
    segment = os.path.join(root, RUN, "log", "rank-00000", f"{1:012d}.log")
    client = tracked(Client(root, RUN, daemon=False, min_free_bytes=0,
                            log_segment_bytes=os.path.getsize(segment)))
    filler = fill(mount)
    out = raised(client.restore)
    os.unlink(filler)
    out["retry_step"] = client.restore()   # the snapshot was kept, whole
    client.close()
    return out


CASES = {"client": case_client, "fresh": case_fresh, "resume": case_resume}


def main() -> None:
    results = {}
    for arg in sys.argv[1:]:
        case, mount = arg.split("=", 1)
        results[case] = CASES[case](mount)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
