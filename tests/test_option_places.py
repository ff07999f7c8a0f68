"""Where each option acts: the three tuples of snapd/options.py cover every field once;
a value survives the trip through a started daemon's environment; a client's submit
carries the run's settings; a daemon refuses a client whose daemon-wide options are
not its own, with a message that says what to do."""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import fields

import pytest

from option_values import non_default_values, value_for
from snapd import protocol as p
from snapd.errors import InvalidOption, OptionMismatch, ProtocolError
from snapd.options import (CLIENT_OPTIONS, DAEMON_OPTIONS, SUBMIT_OPTIONS, Options,
                           check_shared, daemon_environment, given_daemon_options,
                           render, variable)
from snapd.server import Connection, submit_options
from snapd.store import RunStore
from snapd_client.handle import SnapshotHandle
from snapd_client.handoff import Handoff

DEFAULTS = {f.name: f.default for f in fields(Options)}
VALUES = non_default_values()
ROOT = "/data/ckpt"


def test_the_three_tuples_are_exactly_the_options_each_once():
    listed = SUBMIT_OPTIONS + CLIENT_OPTIONS + DAEMON_OPTIONS
    assert len(listed) == len(set(listed)), "an option is in two tuples"
    unplaced = sorted(set(Options.names()) - set(listed))
    assert not unplaced, (f"options {unplaced} are in none of SUBMIT_OPTIONS, "
                          "CLIENT_OPTIONS, DAEMON_OPTIONS (snapd/options.py): say where "
                          "each acts")
    assert sorted(listed) == sorted(Options.names())


def test_the_table_has_a_valid_non_default_value_for_every_option():
    values = {name: value_for(name, VALUES) for name in Options.names()}
    for name, value in values.items():
        assert value != DEFAULTS[name], name
    assert Options(**values) == Options().replace(**values)   # all valid together


@pytest.mark.parametrize("name", Options.names())
def test_every_option_comes_back_from_its_environment_variable(name):
    value = value_for(name, VALUES)
    text = render(name, value)
    environ = {} if text is None else {variable(name): text}
    got = getattr(Options.resolve(environ=environ), name)
    assert got == value and type(got) is type(value)


def test_every_float_comes_back_exactly():
    for value in (0.1, 1 / 3, 1e-9, 12345.678901234567):
        got = Options.resolve(environ={"SNAPD_PEER_TIMEOUT": render("peer_timeout", value)})
        assert got.peer_timeout == value


def test_a_started_daemon_resolves_the_clients_daemon_wide_values():
    client = Options(**{n: VALUES[n] for n in DAEMON_OPTIONS})
    env = daemon_environment(client, {"PATH": "/bin", "SNAPD_WRITER_THREADS": "9"})
    daemon = Options.resolve(environ=env)
    for name in DAEMON_OPTIONS:
        assert getattr(daemon, name) == getattr(client, name), name
    assert env["PATH"] == "/bin"
    # Only the daemon-wide ones: the others reach the daemon with each submit, or not.
    set_there = {k for k in env if k.startswith("SNAPD_")}
    assert set_there == {variable(n) for n in DAEMON_OPTIONS}


def test_a_none_value_removes_the_variable_and_serve_arguments_still_win():
    env = daemon_environment(Options(), {"SNAPD_REMOTE": "file:///elsewhere",
                                         "SNAPD_REMOTE_KEEP_EVERY": "5"})
    assert "SNAPD_REMOTE" not in env and "SNAPD_REMOTE_KEEP_EVERY" not in env
    env = daemon_environment(Options(remote="file:///a", idle_exit_seconds=5.0))
    served = Options.resolve({"remote": "file:///b", "idle_exit_seconds": 0.0}, environ=env)
    assert (served.remote, served.idle_exit_seconds) == ("file:///b", 0.0)


def test_a_client_sends_the_daemon_wide_options_it_was_given_even_the_defaults():
    environ = {"SNAPD_PEER_TIMEOUT": "30", "SNAPD_KEEP_LAST": "3"}
    options = Options.resolve({"remote_keep_last": 2, "timeout": 5.0}, environ=environ)
    given = given_daemon_options(options, {"remote_keep_last": 2, "timeout": 5.0},
                                 environ=environ)
    # remote_keep_last=2 and peer_timeout=30 are the defaults, yet were asked for.
    assert given == {"remote_keep_last": 2, "peer_timeout": 30.0}
    assert given_daemon_options(Options.resolve(environ={}), {}, environ={}) == {}


def test_a_client_handed_an_options_object_sends_what_differs_from_the_default():
    handed = Options(writer_threads=2, hot_linger_seconds=10.0, keep_last=4)
    assert given_daemon_options(handed, {"max_connections": 64}, handed=True,
                                environ={"SNAPD_MIN_FREE_BYTES": "0"}) == \
        {"hot_linger_seconds": 10.0, "max_connections": 64}


def test_the_submit_carries_every_submit_option_of_the_client(tmp_path):
    options = Options(**{n: VALUES[n] for n in SUBMIT_OPTIONS})
    sent = []

    class Recording:   # the connection: what the handoff sends
        lost = None

        def send_request(self, message, on_reply):
            sent.append(message)

    handoff = Handoff(RunStore(str(tmp_path), "r"), 0, options)
    handoff._submit(Recording(), 0, {"objects": []}, SnapshotHandle(1))
    assert [m.op for m in sent] == ["submit"]
    assert sent[0].options == {n: VALUES[n] for n in SUBMIT_OPTIONS}
    # ... and the daemon applies each of them to that run's snapshots.
    applied = submit_options(Options(), sent[0].options)
    for name in SUBMIT_OPTIONS:
        assert getattr(applied, name) == VALUES[name], name


# --- the daemon's check of a joining client ------------------------------------------

def test_equal_values_and_unknown_names_pass_the_check():
    own = Options(remote="s3://bucket/snapd", remote_keep_last=0)
    check_shared(own, None, ROOT)   # a tool or an older client: nothing to check
    check_shared(own, {"remote": "s3://bucket/snapd/", "remote_keep_last": 0,
                       "keep_last": 9, "option_of_a_newer_client": 1}, ROOT)


def test_a_differing_daemon_wide_option_is_refused_with_both_values_and_the_fix():
    with pytest.raises(OptionMismatch) as caught:
        check_shared(Options(), {"remote_keep_last": 0, "writer_threads": 2,
                                 "peer_timeout": 5.0}, ROOT)
    assert str(caught.value) == (
        "the daemon serving /data/ckpt runs with other daemon-wide options than this "
        "client was given: remote_keep_last=2 (this client: 0), peer_timeout=30.0 (this "
        "client: 5.0). Give the client the daemon's values, or stop the daemon "
        "(`snapd stop /data/ckpt`) and start the trainer again: it starts a daemon with "
        "the client's options")
    assert caught.value.field == "remote_keep_last" and caught.value.path == ROOT
    assert isinstance(caught.value, InvalidOption)


def test_a_bool_is_not_taken_for_a_number():
    with pytest.raises(OptionMismatch):
        check_shared(Options(), {"writer_threads": True, "max_connections": 64}, ROOT)


def test_options_that_are_not_a_map_are_a_protocol_error():
    with pytest.raises(ProtocolError):
        check_shared(Options(), ["remote"], ROOT)


class Handler:
    """What a Connection needs of the daemon, with the daemon's own options."""

    def __init__(self, options):
        self.root, self.options, self.lines = ROOT, options, []

    def log(self, message):
        self.lines.append(message)

    def client_left(self, run, rank, clean):
        pass


def hello_reply(handler, hello):
    ours, theirs = socket.socketpair()
    ours.settimeout(10)
    conn = Connection(theirs, handler, os.getpid())
    thread = threading.Thread(target=conn.serve, daemon=True)
    thread.start()
    try:
        p.send(ours, hello, id=1)
        return p.from_wire(p.recv(ours)), conn
    finally:
        ours.close()
        thread.join(5)


def test_the_daemon_refuses_a_differing_hello_and_welcomes_tools_and_older_clients():
    handler = Handler(Options(remote_keep_last=3))
    hello = p.Hello(p.PROTOCOL_VERSION, os.getpid(), "r", 0, {"remote_keep_last": 0})
    reply, conn = hello_reply(handler, hello)
    assert isinstance(reply, p.Error) and reply.kind == "OptionMismatch"
    assert reply.field == "remote_keep_last" and conn.run == ""   # never joined
    assert "remote_keep_last=3 (this client: 0)" in reply.message
    error = reply.exception()
    assert isinstance(error, OptionMismatch) and error.path == ROOT
    pid = os.getpid()
    for hello in (p.Hello(p.PROTOCOL_VERSION, pid, "", 0, {"remote_keep_last": 0}),  # tool
                  p.Hello(p.PROTOCOL_VERSION, pid, "r", 0),   # an older client
                  p.Hello(p.PROTOCOL_VERSION, pid, "r", 0, {"remote_keep_last": 3})):
        assert isinstance(hello_reply(handler, hello)[0], p.Welcome), hello


def test_a_hello_without_options_reads_as_nothing_to_check():
    old = {"op": "hello", "protocol": p.PROTOCOL_VERSION, "pid": 1, "run": "r", "rank": 0}
    assert p.from_wire(old).options is None
    sent = p.to_wire(p.Hello(p.PROTOCOL_VERSION, 1, "r", 0, {"remote": "file:///x"}))
    assert sent["options"] == {"remote": "file:///x"}
