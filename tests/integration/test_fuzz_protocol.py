"""Fuzz the socket framing of a real daemon: seeded, bounded in time.

Garbage lengths, truncated frames, msgpack of the wrong shape, unknown ops, and every
request with each field replaced by a value of another type. Afterwards the daemon
is alive, serves a good client, and never left its error tree ("internal error").
"""

from __future__ import annotations

import os
import random
import struct
import time

import msgpack
import pytest

from snapd import peer as peer_mod
from snapd import protocol as p

from harness import Peer, sample_states, submit

pytestmark = pytest.mark.integration
SEED = int(os.environ.get("SNAPD_FUZZ_SEED", "1104"))
BUDGET = 10.0   # seconds of fuzzing
ODD_VALUES = [None, True, -1, 2 ** 63, 1.5, "", "x" * 300, "../..", b"\x00\xff", [], [1, "a"],
              {}, {"objects": [{"name": 1}]}, {"objects": "no"}, {1: 2}]
REQUESTS = {"hello": {"protocol": p.PROTOCOL_VERSION, "pid": 1, "run": "fz", "rank": 0},
            "attach": {"run": "fz", "rank": 0, "shm": "snapd-0-1-ab", "size": 4096,
                       "slots": 1},
            "submit": {"run": "fz", "rank": 0, "step": 1, "slot": 0,
                       "plan": {"run": "fz", "step": 1, "objects": []}, "options": {}},
            "status": {}, "hot": {"run": "fz", "rank": 0}, "ping": {}, "bye": {}}


def frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def wrong_typed(rng: random.Random) -> bytes:
    op = rng.choice(list(REQUESTS) + ["welcome", "committed", "nope", 7])
    body = dict(REQUESTS.get(op, {}))
    for key in list(body) + ["id", "op"]:
        if rng.random() < 0.4:
            body[key] = rng.choice(ODD_VALUES)
    body.setdefault("op", op)
    if rng.random() < 0.9:
        body.setdefault("id", rng.randrange(1 << 31))
    return frame(msgpack.packb(body, use_bin_type=True))


def garbage(rng: random.Random) -> bytes:
    kind = rng.randrange(5)
    if kind == 0:   # a length, and far fewer bytes than it says
        return struct.pack("<I", rng.randrange(1 << 32)) + rng.randbytes(rng.randrange(64))
    if kind == 1:   # not msgpack
        return frame(rng.randbytes(rng.randrange(1, 200)))
    if kind == 2:   # msgpack, not a map
        return frame(msgpack.packb(rng.choice([1, "s", [1, 2], None, 3.5])))
    if kind == 3:   # a valid frame cut short
        whole = wrong_typed(rng)
        return whole[:rng.randrange(1, len(whole))]
    return frame(msgpack.packb([[[[[]]]]] * 3) + b"\xc1")


def hello() -> bytes:
    return p.encode(p.Hello(p.PROTOCOL_VERSION, os.getpid(), "fz", 0), id=0)


def send_case(root: str, data: bytes) -> None:
    """One connection: maybe a hello first, then the case; read a little, hang up."""
    with peer_mod.connect(root, timeout=0.5) as sock:
        try:
            sock.sendall(data)
            sock.recv(65536)
        except OSError:
            pass


def test_fuzzed_frames_never_break_the_daemon(harness):
    root, run = harness.root(), harness.run
    daemon = harness.start(root, extra_env={"SNAPD_PEER_TIMEOUT": "1"})
    rng = random.Random(SEED)
    deadline, sent = time.monotonic() + BUDGET, 0
    while time.monotonic() < deadline and sent < 4000:
        cases = [wrong_typed(rng) if rng.random() < 0.6 else garbage(rng)
                 for _ in range(rng.randrange(1, 6))]
        send_case(root, (hello() if rng.random() < 0.7 else b"") + b"".join(cases))
        sent += len(cases)
    assert sent >= 1000, f"only {sent} frames in {BUDGET} s"
    assert daemon.proc.poll() is None, daemon.text()
    arena = harness.arena(1 << 20)
    with Peer(root, hello=True, run=run) as peer:
        arena.attach(peer, run)
        submit(peer, arena, run, 1, sample_states())
        assert peer.event()["op"] == "committed"
    log = daemon.text()
    assert "internal error" not in log, [l for l in log.splitlines() if "internal" in l][:5]
    assert "Traceback" not in log, log[-3000:]
