"""snapd/shapipe.py: the SHA-256 taken on a thread is the SHA-256 of the bytes handed
over, in the order handed over; a failure there is raised by digest(), on the caller's
thread."""

from __future__ import annotations

import hashlib
import os

import pytest

from snapd.cpulanes import Lanes
from snapd.shapipe import Sha256Pipe


def test_the_digest_is_of_every_piece_in_order():
    pieces = [os.urandom(n) for n in (0, 1, 4096, 3 << 20, 17)]
    pipe = Sha256Pipe(Lanes(1))
    for piece in pieces:
        pipe.update(memoryview(piece))
    assert pipe.digest() == hashlib.sha256(b"".join(pieces)).digest()


def test_a_failure_on_the_thread_is_raised_by_digest():
    pipe = Sha256Pipe(Lanes(1))
    pipe.update(b"ok")
    pipe.update(object())   # not bytes: hashlib refuses it on the hashing thread
    with pytest.raises(TypeError):
        pipe.digest()


def test_close_waits_for_what_was_handed_over_and_may_be_called_twice():
    pipe = Sha256Pipe(Lanes(1))
    pipe.update(b"abc")
    pipe.close()
    pipe.close()
    assert pipe.digest() == hashlib.sha256(b"abc").digest()
