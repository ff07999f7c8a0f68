"""Every tunable of snapd in one frozen dataclass, with environment overrides in one place.

Precedence: an explicit argument wins over the environment, which wins over the
default. The environment variable for a field is ``SNAPD_<FIELD>`` in upper case
(``SNAPD_COMPRESSION=3``, ``SNAPD_KEEP_LAST=5``). Parsing lives here only, so that no
other module reads ``os.environ`` for a tunable.

Each field acts in one place, and its tuple below says which: the training process
(CLIENT_OPTIONS), the daemon, per run, from each submit (SUBMIT_OPTIONS), or the daemon
as a whole (DAEMON_OPTIONS: one value per daemon, whichever client started it).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from dataclasses import dataclass, fields
from typing import Any, Iterable, Mapping, Optional, Union

from snapd.errors import InvalidOption, OptionMismatch, ProtocolError, UnknownOption

_log = logging.getLogger(__name__)

Compression = Union[str, int]  # "off", "auto", or a zstd level 1..22
Every = Union[None, int, str]  # None, a step count N, or "auto"


# The options a client sends with each submit: the run's writer and retention
# settings, which the daemon applies to that run's snapshots only.
SUBMIT_OPTIONS = ("compression", "chunk_bytes", "keep_last", "keep_every", "keep_best",
                  "best_mode", "hot_restore", "share_unchanged", "sha256")
# The options the training process acts on itself (its handoff, log, restore, waits).
CLIENT_OPTIONS = ("mode", "on_busy", "slots", "copy_threads", "daemon",
                  "log_flush_interval", "log_segment_bytes", "replay_check",
                  "verify_steps", "timeout", "global_commit_timeout", "remote_timeout",
                  "every", "overhead", "max_loss", "mtbf", "anomaly_z", "anomaly_window")
# The options of the daemon as a whole: one value for every client of the root. A
# daemon a client starts gets the client's values (daemon_environment); a client that
# joins a running daemon is refused where its values differ (check_shared).
# ``remote``, ``min_free_bytes`` and ``signing_key_file`` also act in the client
# (restore's pull and checks, the in-process writer), with the same value.
DAEMON_OPTIONS = ("writer_threads", "remote", "remote_keep_last", "remote_keep_every",
                  "remote_upload_threads", "remote_retry_max_seconds",
                  "remote_log_interval", "root_check_seconds", "min_free_bytes",
                  "max_connections", "peer_timeout", "hello_timeout",
                  "hot_linger_seconds", "hot_max_bytes", "idle_exit_seconds",
                  "idle_bare_exit_seconds", "signing_key_file")


@dataclass(frozen=True)
class Options:
    """Tunables of the client, the writer and the daemon.

    An unknown name (``Options(keep_lsat=3)``, ``replace``, ``resolve``) raises
    UnknownOption with the nearest known name; a value out of range, InvalidOption.
    """

    # On-disk layout of tensor data.
    chunk_bytes: int = 4 << 20
    compression: Compression = "off"
    # Retention (applied after each commit; never deletes the last verified snapshot).
    keep_last: Optional[int] = None
    keep_every: Optional[int] = None
    keep_best: int = 0
    best_mode: str = "min"
    # Snapshot handoff.
    mode: str = "wait"            # "wait": snapshot() returns after the copy; "overlap"
    on_busy: str = "wait"         # "wait" for the previous write, or "skip" this one
    slots: int = 1                # staging arena slots (1 or 2)
    copy_threads: int = 4         # threads copying into the arena during snapshot()
    daemon: bool = True           # snapshot through the root's daemon; False: in-process
    writer_threads: int = 2
    hot_restore: bool = True
    # Fine-tuning: a frozen tensor unchanged since a snapshot wrote it is referred to,
    # not copied again (snapd_client/frozen.py), and the writer refers to any tensor
    # whose bytes the newest snapshot holds (snapd/sharing.py); False copies and
    # writes every tensor every time (each snapshot stands alone on disk).
    share_unchanged: bool = True
    # Tamper evidence: the writer records the SHA-256 of every file it writes (and
    # the log, of the manifest), and restore checks them. False saves the daemon
    # about 0.5 CPU-seconds per GiB written; the snapshot is then checked by xxh3
    # alone, which catches damage but not a forgery (docs/operations.md).
    sha256: bool = True
    # Remote tier (docs/remote.md): committed snapshots replicated to an fsspec URL.
    remote: Optional[str] = None  # s3://bucket/prefix or file:///shared/path; None: off
    remote_keep_last: int = 2     # remote retention: the newest N remote commits; 0: all
    remote_keep_every: Optional[int] = None  # ... and every snapshot whose step is a
    #                               multiple of N; the newest remote commit is never deleted
    remote_upload_threads: int = 4   # files uploaded at once
    remote_retry_max_seconds: float = 60.0  # longest wait between retries of a failure
    remote_log_interval: float = 5.0  # how often the state log is replicated
    remote_timeout: float = 10.0  # restore()'s whole remote work (listing, pulling):
    #                               past it, a RemoteWarning and the local disk
    # When snapshot(step) takes one (docs/operations.md, "Snapshot cadence").
    every: Every = None           # None: every call; N: steps that are multiples of N;
    #                               "auto": as often as it pays (snapd_client/cadence.py)
    overhead: float = 0.01        # "auto": the most of the training time snapshots may
    #                               stall it (0.01: one percent)
    max_loss: Optional[float] = None  # "auto": the most seconds of training a failure
    #                               may lose (the interval plus the time to durable)
    mtbf: Optional[float] = None  # "auto": seconds between failures; None: learned from
    #                               the run's resumes, else 24 hours
    # State log.
    log_flush_interval: float = 1.0
    log_segment_bytes: int = 64 << 20
    replay_check: str = "raise"   # "raise", "warn" or "off"
    verify_steps: int = 0         # k > 0: a resume with nothing to recompute starts from
    #                               a snapshot at most k steps older, to check the steps
    # Anomalies in the logged loss (snapd_client/anomaly.py): a loss whose robust
    # z-score against the last anomaly_window losses exceeds anomaly_z is a spike, and
    # pins the newest snapshot before it (as a NaN loss or grad norm does); 0: no spikes.
    anomaly_z: float = 6.0
    anomaly_window: int = 100
    # Daemon liveness.
    timeout: float = 120.0        # longest wait for any daemon reply
    global_commit_timeout: float = 30.0  # close(): longest wait for the other ranks'
    #                               parts of the newest multi-rank snapshot
    root_check_seconds: float = 5.0  # how often the daemon checks its socket is there
    min_free_bytes: int = 64 << 20
    # The daemon towards its peers (docs/protocol.md, "Limits").
    max_connections: int = 64     # more are refused with an error frame, then closed
    peer_timeout: float = 30.0    # a peer that does not read (or finish a frame) for
    #                               this long is dropped; its snapshots finish
    hello_timeout: float = 5.0    # a connection that has not said hello this long after
    #                               connecting is closed, however slowly its bytes come
    hot_linger_seconds: float = 300.0  # a crashed client's hot copy is kept this long
    hot_max_bytes: int = 0        # all hot copies together; 0: a quarter of the RAM
    idle_exit_seconds: float = 600.0  # a client-started daemon exits after this long
    #                               with no client and nothing in flight; 0: never
    # Signed commits (snapd/signing.py): a file of keys, one per line, the first signs
    # (unless SNAPD_SIGNING_KEY, the key itself, is set) and all are accepted; the
    # daemon signs manifests and records with it, restore refuses what no accepted key
    # signed. None, and no SNAPD_SIGNING_KEY: nothing signed, nothing checked. Made
    # absolute at once: a daemon the client starts runs in "/".
    signing_key_file: Optional[str] = None
    idle_bare_exit_seconds: float = 60.0  # ... and after this long (the shorter of the
    #                               two) when it also keeps nothing: no hot copy held,
    #                               no upload pending; 0: idle_exit_seconds alone

    def __new__(cls, *args: Any, **kwargs: Any) -> "Options":
        # Before the generated __init__, whose TypeError would not name the options.
        cls.check_names(kwargs)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if self.signing_key_file:   # a relative path would name another file in "/"
            object.__setattr__(self, "signing_key_file",
                               os.path.abspath(self.signing_key_file))
        _check_choice("mode", self.mode, ("wait", "overlap"))
        _check_choice("on_busy", self.on_busy, ("wait", "skip"))
        _check_choice("best_mode", self.best_mode, ("min", "max"))
        _check_choice("replay_check", self.replay_check, ("raise", "warn", "off"))
        if isinstance(self.compression, str) and self.compression not in ("off", "auto"):
            raise InvalidOption(f"compression={self.compression!r}: use 'off', 'auto' "
                                "or a zstd level 1..22", field="compression")
        if isinstance(self.compression, int) and not 1 <= self.compression <= 22:
            raise InvalidOption(f"compression={self.compression}: zstd levels are 1..22",
                                field="compression")
        if self.chunk_bytes < 4096 or self.chunk_bytes % 4096:
            raise InvalidOption(f"chunk_bytes={self.chunk_bytes}: use a multiple of 4096 "
                                "(chunks are written in 4096-byte blocks)",
                                field="chunk_bytes")
        if not self.root_check_seconds > 0:
            raise InvalidOption(f"root_check_seconds={self.root_check_seconds}: a "
                                "positive number of seconds", field="root_check_seconds")
        if self.copy_threads < 1:
            raise InvalidOption(f"copy_threads={self.copy_threads}: at least 1 (the "
                                "calling thread); more share the staging copy, up to the "
                                "usable CPUs", field="copy_threads")
        for name in ("max_connections", "peer_timeout", "hello_timeout",
                     "global_commit_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidOption(f"{name}={getattr(self, name)}: a positive number",
                                    field=name)
        for name in ("hot_linger_seconds", "hot_max_bytes", "idle_exit_seconds",
                     "idle_bare_exit_seconds"):
            if getattr(self, name) < 0:
                raise InvalidOption(f"{name}={getattr(self, name)}: zero or more",
                                    field=name)
        _check_verify_steps(self.verify_steps, self.keep_last)
        _check_anomaly(self)
        _check_cadence(self)
        _check_remote(self)
        if self.slots not in (1, 2):
            raise InvalidOption(f"slots={self.slots}: the staging arena has 1 or 2 slots",
                                field="slots")

    @classmethod
    def resolve(cls, overrides: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> "Options":
        """Defaults, then ``SNAPD_*`` environment variables, then ``overrides``."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(f"SNAPD_{f.name.upper()}")
            if raw is not None:
                values[f.name] = _parse(f.name, raw, f.default)
        _warn_env_typos(environ, cls.names())
        cls.check_names(overrides or {})
        values.update((k, v) for k, v in (overrides or {}).items() if v is not None)
        return cls(**values)

    def replace(self, **changes: Any) -> "Options":
        return dataclasses.replace(self, **changes)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def check_names(cls, given: Iterable[str], *, also: Iterable[str] = (),
                    where: str = "Options") -> None:
        """Raise UnknownOption for the first name that is neither an option nor one of
        ``also`` (the caller's own parameters), naming the nearest known name."""
        known = cls.names() + list(also)
        for name in given:
            if name not in known:
                near = difflib.get_close_matches(str(name), known, n=1)
                hint = f"did you mean {near[0]!r}? " if near else ""
                raise UnknownOption(
                    f"{where}({name}=...): {name!r} is not a snapd option; {hint}"
                    f"known: {', '.join(sorted(known))}", field=str(name))


def _check_choice(name: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise InvalidOption(f"{name}={value!r}: choose one of "
                            f"{', '.join(map(repr, allowed))}", field=name)


def _check_verify_steps(k: int, keep_last: Optional[int]) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise InvalidOption(f"verify_steps={k!r}: 0 (off) or the most steps a resume may "
                            "recompute to check them", field="verify_steps")
    if k and keep_last == 1:  # the snapshot before the newest is the one it resumes from
        raise InvalidOption(f"verify_steps={k} with keep_last=1: retention would delete "
                            "the older snapshot it resumes from; use keep_last=2 or more",
                            field="verify_steps")


def _check_anomaly(o: "Options") -> None:
    if not _number(o.anomaly_z) or not (o.anomaly_z >= 0 and o.anomaly_z < float("inf")):
        raise InvalidOption(f"anomaly_z={o.anomaly_z!r}: the robust z-score above which a "
                            "logged loss is a spike, a number > 0 (6 by default), or 0 to "
                            "notice non-finite values only", field="anomaly_z")
    if isinstance(o.anomaly_window, bool) or not isinstance(o.anomaly_window, int) \
            or o.anomaly_window < 20:
        raise InvalidOption(f"anomaly_window={o.anomaly_window!r}: how many past losses a "
                            "spike is judged against, an int of at least 20",
                            field="anomaly_window")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_cadence(o: "Options") -> None:
    """``every`` and the cadence's three figures (docs/operations.md, "Snapshot
    cadence")."""
    every = o.every
    if not (every is None or every == "auto" or
            (isinstance(every, int) and not isinstance(every, bool) and every > 0)):
        raise InvalidOption(f"every={every!r}: None (each snapshot() call takes one), a "
                            "positive step count N (the steps that are multiples of N) "
                            "or 'auto' (as often as it pays)", field="every")
    if not (_number(o.overhead) and 0 < o.overhead < 1):
        raise InvalidOption(f"overhead={o.overhead!r}: the share of training time "
                            "snapshots may stall it, between 0 and 1 (0.01: one "
                            "percent)", field="overhead")
    for name, meaning in (("max_loss", "the most seconds of training a failure may "
                                       "lose"),
                          ("mtbf", "the seconds between failures")):
        value = getattr(o, name)
        if value is not None and not (_number(value) and value > 0):
            raise InvalidOption(f"{name}={value!r}: {meaning}, a positive number, or "
                                "None", field=name)


def _check_remote(o: "Options") -> None:
    if o.remote is not None:
        if not isinstance(o.remote, str) or "://" not in o.remote:
            raise InvalidOption(f"remote={o.remote!r}: an fsspec URL such as "
                                "s3://bucket/prefix or file:///shared/path", field="remote")
        netloc = o.remote.split("://", 1)[1].split("/", 1)[0]
        if "@" in netloc:   # never kept in Options: it would reach logs, status, argv
            raise InvalidOption("remote=<a URL with user:password@>: put credentials in "
                                "the environment (AWS_ACCESS_KEY_ID, "
                                "AWS_SECRET_ACCESS_KEY) or fsspec's configuration, and "
                                "give the URL without them", field="remote")
    if o.remote_keep_last < 0:
        raise InvalidOption(f"remote_keep_last={o.remote_keep_last}: 0 (keep every remote "
                            "commit) or more", field="remote_keep_last")
    if o.remote_keep_every is not None and o.remote_keep_every < 1:
        raise InvalidOption(f"remote_keep_every={o.remote_keep_every}: a positive step "
                            "count, or None", field="remote_keep_every")
    for name in ("remote_upload_threads", "remote_retry_max_seconds",
                 "remote_log_interval", "remote_timeout"):
        if not getattr(o, name) > 0:
            raise InvalidOption(f"{name}={getattr(o, name)}: a positive number", field=name)


# SNAPD_* variables that are not options (scripts and tests read them).
_OTHER_VARIABLES = {"SNAPD_ROOT", "SNAPD_FUZZ_SEED", "SNAPD_SESSION", "SNAPD_REPRO",
                    "SNAPD_SIGNING_KEY"}   # a secret, never an option (snapd/signing.py)


def _warn_env_typos(environ: Mapping[str, str], known: list[str]) -> None:
    """Warn about a SNAPD_* variable that is close to an option's but is none.

    Only warned, never raised: the environment is shared with other programs, and
    only a near miss (SNAPD_KEEP_LSAT) is worth a line.
    """
    variables = {f"SNAPD_{name.upper()}": name for name in known}
    for key in environ:
        if not key.startswith("SNAPD_") or key in variables or key in _OTHER_VARIABLES:
            continue
        near = difflib.get_close_matches(key, list(variables), n=1, cutoff=0.8)
        if near:
            _log.warning("environment variable %s is not a snapd option and is ignored; "
                         "did you mean %s (option %s)?", key, near[0], variables[near[0]])


def _parse(name: str, raw: str, default: Any) -> Any:
    """Turn one environment string into the field's type, naming the variable on error."""
    try:
        if name == "remote":   # SNAPD_REMOTE= (empty): off
            return raw or None
        if name == "compression":
            return raw if raw in ("off", "auto") else int(raw)
        if name == "every":   # SNAPD_EVERY=auto or a step count
            return raw if raw == "auto" else int(raw)
        if name in ("max_loss", "mtbf"):   # seconds; their default is None
            return float(raw)
        if isinstance(default, bool):
            return raw.strip().lower() in ("1", "true", "yes", "on")
        if isinstance(default, int) or (default is None and "keep_" in name):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        return raw
    except ValueError as e:
        raise InvalidOption(f"environment variable SNAPD_{name.upper()}={raw!r} is not "
                            f"valid for {name}: {e}", field=name) from e


# --- where an option acts: the daemon the client starts, or the one it joins ---------

def variable(name: str) -> str:
    """The environment variable of option ``name``: ``SNAPD_<NAME>``."""
    return f"SNAPD_{name.upper()}"


def render(name: str, value: Any) -> Optional[str]:
    """The environment string from which Options.resolve gives back ``value`` for
    option ``name`` (``_parse`` of it equals it); None: no variable (the fields whose
    default is None, and ``remote``, read an absent variable as None)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return repr(value)   # the shortest string that float() reads back exactly
    return str(value)


def daemon_environment(options: Options,
                       environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) with every daemon-wide option set to
    ``options``' value: a daemon started with it resolves the client's values, while
    its explicit arguments (``serve --remote``, ``--idle-exit``) still win."""
    env = dict(os.environ if environ is None else environ)
    for name in DAEMON_OPTIONS:
        text = render(name, getattr(options, name))
        if text is None:
            env.pop(variable(name), None)
        else:
            env[variable(name)] = text
    return env


_DEFAULTS = {f.name: f.default for f in fields(Options)}


def given_daemon_options(options: Options, overrides: Iterable[str] = (), *,
                         handed: bool = False,
                         environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The daemon-wide options a client was explicitly given, with its values: its
    keyword arguments (``overrides``), and the ``SNAPD_*`` variables it resolved, or,
    for an Options object it was ``handed``, the fields that differ from the default.

    Sent in hello even when equal to the default: the running daemon may have others.
    """
    environ = os.environ if environ is None else environ
    names = set(overrides)
    if handed:
        names |= {n for n in DAEMON_OPTIONS if getattr(options, n) != _DEFAULTS[n]}
    else:
        names |= {n for n in DAEMON_OPTIONS if variable(n) in environ}
    return {n: getattr(options, n) for n in DAEMON_OPTIONS if n in names}


def _same(name: str, own: Any, given: Any) -> bool:
    if name == "remote" and isinstance(own, str) and isinstance(given, str):
        return own.rstrip("/") == given.rstrip("/")   # one prefix, however written
    return own == given and isinstance(own, bool) == isinstance(given, bool)


def check_shared(own: Options, given: Any, root: str) -> None:
    """Refuse (OptionMismatch) a client whose daemon-wide options differ from the
    daemon's: one daemon serves every client of a root with one value of each, and a
    client that believed its own would be applied (``remote_keep_last=0`` keeping
    every remote commit) would lose what it asked to keep. ``given`` None: a client
    that sends none (a tool, an older client) is never refused; names this daemon
    does not know (a newer client's) are left out."""
    if given is None:
        return
    if not isinstance(given, dict):
        raise ProtocolError(f"hello options must be a map of option names, got "
                            f"{type(given).__name__}", field="options")
    differ = [(n, getattr(own, n), given[n]) for n in DAEMON_OPTIONS
              if n in given and not _same(n, getattr(own, n), given[n])]
    if not differ:
        return
    listed = ", ".join(f"{n}={mine!r} (this client: {theirs!r})"
                       for n, mine, theirs in differ)
    raise OptionMismatch(
        f"the daemon serving {root} runs with other daemon-wide options than this "
        f"client was given: {listed}. Give the client the daemon's values, or stop the "
        f"daemon (`snapd stop {root}`) and start the trainer again: it starts a daemon "
        "with the client's options", path=root, field=differ[0][0])
