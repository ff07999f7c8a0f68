"""Every rank restores the same snapshot, or none does: the agreement on one candidate.

Restore on many ranks (snapd_client/distrestore.py) runs once, at start, so it may use
collectives; they go over the client's private gloo group (snapd_client/ranks.py), as
JSON bytes. Rank 0 lists the candidates and a fresh session token and broadcasts them;
for each candidate in turn every rank reads what it needs and the verdicts are
all-gathered: all ok, every rank takes it; damage on any rank, every rank warns
(FallbackWarning) naming the rank(s) and file(s) and all try the next; a candidate that
does not fit on some rank (or another failure) stops every rank with the same error,
since an older one would not fit either. None left after refusals: every rank raises
the same CorruptSnapshot.
"""

from __future__ import annotations

import json
import secrets
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from snapd.errors import CorruptSnapshot, IncompatibleState, SnapdError
from snapd.store import RunStore
from snapd_client.ranks import Collective
from snapd_client.restore import FallbackWarning, Pending, resume_order


@dataclass
class Agreed:
    """The candidate every rank read, with what the refused newer ones were."""

    name: Optional[str]            # None: the run has no snapshot
    prepared: Any
    refused: Dict[str, str]
    passed_over: Optional[str]
    session: str


def plan(store: RunStore, reached: Optional[int], verify_steps: int,
         at_most: Optional[int] = None, first: Optional[Pending] = None
         ) -> Dict[str, Any]:
    """Rank 0's list: restore.py's order (``at_most``, snapd repro: the snapshots of
    steps up to it only; ``first``, a pull pending on every root, tried first), and a
    fresh session for this attempt."""
    order, pick = resume_order(store, reached, verify_steps, at_most, first)
    return {"order": [sid.name for sid in order],
            "passed_over": order[1].name if pick is not None else None,
            "session": secrets.token_hex(8)}


def agree(coll: Collective, make_plan: Callable[[], Dict[str, Any]],
          try_one: Callable[[str], Any], where: str) -> Agreed:
    """The agreement of the module docstring (steps 3 to 5 of distrestore.py's), over
    ``coll``. ``try_one(name)`` reads candidate ``name`` on this rank; ``where``
    names the snapshots dir in errors."""
    listed = json.loads(coll.broadcast_bytes(_plan_bytes(make_plan) if coll.rank == 0
                                             else None, src=0))
    if "error" in listed:  # rank 0 could not list the snapshots: nobody may wait on it
        raise SnapdError(f"{where}: rank 0 could not list the snapshots: "
                         f"{listed['error']}", path=where, field="snapshots")
    refused: Dict[str, str] = {}
    for name in listed["order"]:
        result, error, verdict = None, None, {"status": "ok"}
        try:
            result = try_one(name)
        except Exception as e:  # every rank must hear of it, or the others wait
            error, verdict = e, _verdict(e)
        gathered = coll.allgather_bytes(json.dumps(verdict).encode())
        verdicts = [json.loads(v) for v in gathered]
        if all(v["status"] == "ok" for v in verdicts):
            return Agreed(name, result, refused, listed["passed_over"]
                          if name == listed["order"][0] else None, listed["session"])
        _stop_if_not_damage(verdicts, error, name)
        refused[name] = "; ".join(f"rank {r}: {v['path']}: {v['message']}"
                                  for r, v in enumerate(verdicts) if v["status"] != "ok")
        warnings.warn(f"snapshot {name} refused by every rank: {refused[name]}; trying an "
                      "older one (the refused snapshot is left on disk)", FallbackWarning,
                      stacklevel=4)
    if refused:
        raise CorruptSnapshot(f"{where}: no snapshot verifies on every rank; refused: "
                              + "; ".join(f"{n}: {why}" for n, why in refused.items())
                              + ". To start over, use a new run name (the damaged "
                              "snapshots are kept for inspection). Every tracked object "
                              "is untouched", path=where, field="snapshots")
    return Agreed(None, None, refused, None, listed["session"])


def _plan_bytes(make_plan: Callable[[], Dict[str, Any]]) -> bytes:
    try:
        return json.dumps(make_plan()).encode()
    except Exception as e:  # sent, so that the other ranks stop too
        return json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()


def _verdict(e: Exception) -> Dict[str, Any]:
    status = "corrupt" if isinstance(e, CorruptSnapshot) else \
        "incompatible" if isinstance(e, IncompatibleState) else "error"
    return {"status": status, "message": str(e), "path": getattr(e, "path", None),
            "field": getattr(e, "field", None), "type": type(e).__name__}


def _stop_if_not_damage(verdicts: List[Dict[str, Any]], mine: Optional[Exception],
                        name: str) -> None:
    """A candidate that does not fit (or a failure other than damage) on any rank
    stops every rank: an older snapshot would not fit either."""
    stops = [(r, v) for r, v in enumerate(verdicts) if v["status"] not in ("ok", "corrupt")]
    if not stops:
        return
    if mine is not None and not isinstance(mine, CorruptSnapshot):
        raise mine
    rank, v = stops[0]
    cls = IncompatibleState if v["status"] == "incompatible" else SnapdError
    raise cls(f"snapshot {name}: rank {rank} cannot restore it: {v['message']} "
              f"({v['type']}); every rank stops, untouched", path=v["path"],
              field=v["field"])
