"""A valid value other than the default for every option, all valid together.

The tests of where options act (tests/test_option_places.py,
tests/integration/test_option_reach.py) walk snapd.options' tuples and look each
name up here: a field added to Options without a value here fails them by name.
"""

from __future__ import annotations

from typing import Any, Dict


def non_default_values(remote: str = "file:///srv/snapd-remote",
                       key_file: str = "/srv/snapd-keys") -> Dict[str, Any]:
    """{option: a non-default value}; ``remote`` is the URL to use for ``remote``,
    ``key_file`` the file of signing keys for ``signing_key_file``."""
    return {
        # submit
        "compression": 3, "chunk_bytes": 8192, "keep_last": 5, "keep_every": 10,
        "keep_best": 1, "best_mode": "max", "hot_restore": False,
        "share_unchanged": False, "sha256": False,
        # client
        "mode": "overlap", "on_busy": "skip", "slots": 2, "copy_threads": 2,
        "daemon": False, "log_flush_interval": 0.5, "log_segment_bytes": 1 << 20,
        "replay_check": "warn", "verify_steps": 2, "timeout": 90.0,
        "global_commit_timeout": 20.0, "remote_timeout": 12.5,
        "every": "auto", "overhead": 0.05, "max_loss": 600.0, "mtbf": 7200.0,
        "anomaly_z": 4.5, "anomaly_window": 50,
        # daemon-wide
        "writer_threads": 3, "remote": remote, "remote_keep_last": 0,
        "remote_keep_every": 7, "remote_upload_threads": 2,
        "remote_retry_max_seconds": 7.5, "remote_log_interval": 2.5,
        "root_check_seconds": 0.75, "min_free_bytes": 0, "max_connections": 32,
        "peer_timeout": 25.0, "hello_timeout": 4.0, "hot_linger_seconds": 120.0,
        "hot_max_bytes": 1 << 30, "idle_exit_seconds": 900.0,
        "idle_bare_exit_seconds": 45.0, "signing_key_file": key_file,
    }


def value_for(name: str, values: Dict[str, Any]) -> Any:
    """The table's value for ``name``, failing loudly for a field it lacks."""
    assert name in values, (f"option {name!r} has no non-default value in "
                            "tests/option_values.py: add one (valid per "
                            "Options.__post_init__)")
    return values[name]

