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


# --- the whole tree crosses the socket ------------------------------------------------

def _all_snapd_error_classes():
    """Every SnapdError subclass defined anywhere in snapd and snapd_client."""
    import importlib
    import pkgutil

    import snapd_client
    for package in (snapd, snapd_client):
        for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not module.name.endswith("__main__"):
                importlib.import_module(module.name)
    found, todo = set(), [SnapdError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found and sub.__module__.split(".")[0] in ("snapd", "snapd_client"):
                found.add(sub)
                todo.append(sub)
    return found


def test_every_snapd_error_anywhere_is_in_the_tree_and_crosses_the_socket():
    # A class defined outside snapd.errors would cross as a plain SnapdError.
    for cls in sorted(_all_snapd_error_classes(), key=lambda c: c.__name__):
        name = cls.__name__
        assert cls.__module__ == "snapd.errors", f"{name} is defined in {cls.__module__}"
        assert name in errors.__all__ and f"── {name} " in errors.__doc__, name
        sent = cls("refused; do this", path="/r/run/x", field="objects.model.w")
        got = through_socket(p.Error.of(sent)).exception()
        assert type(got) is cls, name
        assert (str(got), got.path, got.field) == (str(sent), sent.path, sent.field)


def test_every_errors_own_fields_are_read_back():
    for cls in SNAPD_ERRORS:
        own = set(cls("m").wire_fields())
        assert own <= errors._EXTRA_KEYS, f"{cls.__name__}: {own - errors._EXTRA_KEYS}"


def test_a_dangling_reference_keeps_its_old_import_and_crosses_by_class():
    from snapd.globalcommit import DanglingReference
    assert DanglingReference is errors.DanglingReference
    sent = DanglingReference("rank 1 does not hold it", path="/r/snapshots/.parts-x",
                             field="objects.model.w.ref")
    got = through_socket(p.Failed.of("run", 1, 3, 0, sent)).exception()
    assert type(got) is DanglingReference and got.field == "objects.model.w.ref"


def test_a_protocol_mismatch_is_caught_by_type_with_its_field():
    sock, conn, thread = _connected()
    with sock:
        p.send(sock, p.Hello(p.PROTOCOL_VERSION + 98, 1), id=1)
        reply = p.from_wire(p.recv(sock))
        assert isinstance(reply, p.Error) and reply.kind == "ProtocolMismatch"
        got = reply.exception()
        assert type(got) is errors.ProtocolMismatch
        assert isinstance(got, errors.DaemonUnavailable)
        assert (got.field, got.path) == ("protocol", "/r")
        assert str(got) == (f"client speaks protocol {p.PROTOCOL_VERSION + 98}, this "
                            f"daemon {p.PROTOCOL_VERSION}; run the same snapd version "
                            "on both sides")
        thread.join(5)
        assert conn.closed   # then the connection is closed
        with pytest.raises(EOFError):
            p.recv(sock)


# --- SNAPD_ROOT, read in one place ----------------------------------------------------

def test_the_root_is_the_argument_else_snapd_root_else_here(monkeypatch, tmp_path):
    from snapd.commands.common import given_root, resolve_root
    monkeypatch.setenv("SNAPD_ROOT", str(tmp_path))
    assert given_root(None) == str(tmp_path) and given_root("/elsewhere") == "/elsewhere"
    assert resolve_root(None) == str(tmp_path)
    monkeypatch.delenv("SNAPD_ROOT")
    assert given_root(None) == "."
    monkeypatch.setenv("SNAPD_ROOT", str(tmp_path / "absent"))
    with pytest.raises(SystemExit) as info:
        resolve_root(None)
    assert info.value.code == 2


def test_commands_read_snapd_root_only_through_given_root():
    import pathlib
    commands = pathlib.Path(snapd.__file__).parent / "commands"
    readers = [f.name for f in commands.glob("*.py") if '"SNAPD_ROOT"' in f.read_text()]
    assert readers == ["common.py"]


# --- user input refused as errors of the tree, naming the field ----------------------

def test_argument_errors_name_their_field():
    from snapd.outputcheck import largest_difference
    from snapd.store import check_run_name
    from snapd_client.basemodel import Base
    from snapd_client.values import check_name
    from snapd_client.values import adapt
    cases = [
        (lambda: check_run_name("../up"), InvalidOption, "run"),
        (lambda: Base.of({"name": "m", "revision": "1", "digest": "x"}), InvalidOption,
         "base.digest"),
        (lambda: Base("", "1"), InvalidOption, "base.name"),
        (lambda: Base.of(3), InvalidOption, "base"),
        (lambda: check_name("1st", "values"), InvalidOption, "1st"),
        (lambda: adapt("lr", 0.1), errors.UnsupportedState, "lr"),
        (lambda: adapt("gen", object()), errors.UnsupportedState, "gen"),
        (lambda: largest_difference([], []), errors.IncompatibleState, "outputs"),
    ]
    for make, cls, field in cases:
        with pytest.raises(cls) as info:
            make()
        assert info.value.field == field, (cls, field, str(info.value))


def test_client_arguments_are_invalid_options(tmp_path):
    import torch
    client = Client(str(tmp_path), "run", daemon=False)
    try:
        client.track(model=torch.nn.Linear(2, 2))
        with pytest.raises(InvalidOption) as info:
            client.snapshot(-1)
        assert isinstance(info.value, ValueError) and info.value.field == "step"
        with pytest.raises(InvalidOption) as info:
            client.restore(mode="later")
        assert info.value.field == "mode" and "'warm_start'" in str(info.value)
        with pytest.raises(InvalidOption) as info:
            client.log(-1, loss=1.0)
        assert info.value.field == "step" and "completed updates" in str(info.value)
    finally:
        client.close()
