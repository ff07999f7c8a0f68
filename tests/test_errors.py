"""The error model: every snapd error keeps its class, path, field and own fields
across the daemon's socket; option typos and bad values are snapd errors that name
the option."""

from __future__ import annotations

import errno
import inspect
import os
import socket
import threading

import pytest

import snapd.protocol
from snapd import errors
from snapd import protocol as p
from snapd.errors import (InvalidOption, ProtocolError, ReplayDivergence, RunInUse,
                          SnapdError, SnapshotExists, UnknownOption)
from snapd.options import Options
from snapd.server import Connection, submit_options
from snapd_client import Client

SNAPD_ERRORS = [cls for _, cls in inspect.getmembers(errors, inspect.isclass)
                if issubclass(cls, SnapdError)]


def through_socket(message):
    """A message as the peer decodes it: encoded, framed, sent, received."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(p.encode(message, re=1))
        return p.from_wire(p.recv(ours))


@pytest.mark.parametrize("cls", SNAPD_ERRORS, ids=lambda c: c.__name__)
def test_every_snapd_error_crosses_with_class_path_and_field(cls):
    sent = cls("it broke; do this", path="/root/run/snapshots/x", field="rng.cuda:1")
    got = through_socket(p.Error.of(sent)).exception()
    assert type(got) is cls
    assert (str(got), got.path, got.field) == (str(sent), sent.path, sent.field)


def test_own_fields_cross_too():
    got = through_socket(p.Error.of(ReplayDivergence(
        "step 7 differs", step=7, cause="rng:torch", path="/r/log", field="rng"))).exception()
    assert isinstance(got, ReplayDivergence)
    assert (got.step, got.cause, got.path, got.field) == (7, "rng:torch", "/r/log", "rng")
    got = through_socket(p.Error.of(RunInUse("busy", path="/r/.lock", holder=42))).exception()
    assert isinstance(got, RunInUse) and (got.holder, got.path) == (42, "/r/.lock")


def test_a_failed_event_carries_the_error():
    sent = SnapshotExists("another history holds it", path="/r/snapshots/s1",
                          field="lineage")
    event = through_socket(p.Failed.of("run", 0, 5, 1, sent))
    assert (event.run, event.step, event.slot, event.kind) == ("run", 5, 1, "SnapshotExists")
    got = event.exception()
    assert isinstance(got, SnapshotExists) and isinstance(got, FileExistsError)
    assert (got.path, got.field) == ("/r/snapshots/s1", "lineage")


def test_a_builtin_os_error_keeps_errno_and_file():
    sent = FileExistsError(errno.EEXIST, "File exists", "/r/run/snapshots")
    got = through_socket(p.Failed.of("run", 0, 1, 0, sent)).exception()
    assert type(got) is FileExistsError
    assert (got.errno, got.filename) == (errno.EEXIST, "/r/run/snapshots")


def test_an_older_peer_sending_kind_and_message_only_is_understood():
    got = p.from_wire({"op": "error", "re": 1, "kind": "CorruptSnapshot",
                       "message": "bad"}).exception()
    assert isinstance(got, errors.CorruptSnapshot) and str(got) == "bad"
    assert (got.path, got.field) == (None, None)
    event = p.from_wire({"op": "failed", "run": "r", "rank": 0, "step": 1, "slot": 0,
                         "kind": "InsufficientSpace", "message": "full"})
    assert isinstance(event.exception(), errors.InsufficientSpace)


def test_an_unknown_or_hostile_kind_is_a_plain_snapd_error():
    for kind in ("NoSuchError", "__import__", "exec", "SystemExit", "KeyboardInterrupt"):
        got = errors.from_wire({"kind": kind, "message": "m", "path": 3, "extra": "x"})
        assert type(got) is SnapdError and kind in str(got) and got.path is None


def test_protocol_error_has_one_home():
    assert snapd.protocol.ProtocolError is ProtocolError
    assert issubclass(ProtocolError, SnapdError) and issubclass(ProtocolError, ValueError)


class _Handler:
    root, options = "/r", Options()

    def log(self, message):
        pass

    def client_left(self, run, rank, clean):
        pass


def _connected():
    ours, theirs = socket.socketpair()
    ours.settimeout(10)
    conn = Connection(theirs, _Handler(), os.getpid())
    thread = threading.Thread(target=conn.serve, daemon=True)
    thread.start()
    return ours, conn, thread


def test_a_refused_request_replies_with_the_errors_field():
    sock, conn, thread = _connected()
    with sock:
        p.send(sock, p.Hello(p.PROTOCOL_VERSION, 1, "r"), id=1)
        assert p.recv(sock)["op"] == "welcome"
        p.send(sock, p.Submit("r", 0, -1, 0, {}), id=2)
        reply = p.from_wire(p.recv(sock))
        assert isinstance(reply, p.Error) and reply.field == "step"
        p.send(sock, p.HotGet("../elsewhere"), id=3)
        assert p.from_wire(p.recv(sock)).exception().field == "run"
    thread.join(5)


def test_a_protocol_error_in_a_request_still_closes_the_connection():
    # ProtocolError is a SnapdError now: it must not become an error reply.
    sock, conn, thread = _connected()
    with sock:
        p.send(sock, p.Hello(p.PROTOCOL_VERSION, "not a pid"), id=1)
        thread.join(5)
        assert conn.closed
        with pytest.raises(EOFError):
            p.recv(sock)


def test_submit_options_refused_as_invalid_option_naming_it():
    with pytest.raises(InvalidOption) as info:
        submit_options(Options(), {"compression": "bogus"})
    assert info.value.field == "options.compression"
    with pytest.raises(InvalidOption) as info:
        submit_options(Options(), {"keep_last": -1})
    assert info.value.field == "options.keep_last"


# --- option typos -------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: Options(keep_lsat=3),
    lambda: Options().replace(keep_lsat=3),
    lambda: Options.resolve({"keep_lsat": 3}),
], ids=["Options", "replace", "resolve"])
def test_an_option_typo_names_the_nearest_option_and_lists_all(make):
    with pytest.raises(UnknownOption) as info:
        make()
    assert isinstance(info.value, TypeError) and info.value.field == "keep_lsat"
    assert "did you mean 'keep_last'" in str(info.value)
    assert all(name in str(info.value) for name in ("keep_every", "compression", "slots"))


def test_a_client_option_typo_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(UnknownOption, match="did you mean 'keep_last'") as info:
        Client(str(tmp_path / "root"), "run", keep_lsat=3)
    assert info.value.field == "keep_lsat" and "Client(keep_lsat=" in str(info.value)
    assert not (tmp_path / "root").exists()
    with pytest.raises(UnknownOption, match="did you mean 'read_only'"):
        Client(str(tmp_path / "root"), "run", read_onyl=True)


def test_a_mistyped_environment_variable_is_warned_about_not_raised(capsys):
    opts = Options.resolve(environ={"SNAPD_KEEP_LSAT": "3", "SNAPD_ROOT": "/x",
                                    "SNAPD_DEBUG": "1"})
    assert opts.keep_last is None
    err = capsys.readouterr().err
    assert "SNAPD_KEEP_LSAT" in err and "SNAPD_KEEP_LAST" in err
    assert "SNAPD_ROOT" not in err and "SNAPD_DEBUG" not in err


@pytest.mark.parametrize("kwargs, field", [
    ({"slots": 3}, "slots"), ({"compression": 30}, "compression"),
    ({"mode": "later"}, "mode"), ({"chunk_bytes": 1000}, "chunk_bytes"),
])
def test_a_bad_option_value_is_invalid_option_naming_it(kwargs, field):
    with pytest.raises(InvalidOption) as info:
        Options(**kwargs)
    assert isinstance(info.value, ValueError) and info.value.field == field


def test_a_bad_environment_value_names_the_variable():
    with pytest.raises(InvalidOption, match="SNAPD_KEEP_LAST") as info:
        Options.resolve(environ={"SNAPD_KEEP_LAST": "many"})
    assert info.value.field == "keep_last"
