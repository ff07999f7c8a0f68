"""Signed commits: an HMAC-SHA-256 on each manifest, commit record and remote record.

Why: the SHA-256s (docs/format.md, "SHA-256 and the state log") show that a snapshot
is what was committed, as long as the log that witnessed the commit is not rewritten
too. A snapshot that comes back from object storage, which other people and machines
can write, has no such witness on a new node. A key shared by the machines that may
write snapshots, and by those that restore, settles it: a file signed with it was
written by one of them.

Where the key comes from, never from a command line (it would show in ``ps``):
- ``SNAPD_SIGNING_KEY``: the key itself (its UTF-8 bytes), in the environment of the
  client, and so of the daemon it starts;
- option ``signing_key_file`` (``SNAPD_SIGNING_KEY_FILE``): a file of keys, one per
  line; the first signs (unless ``SNAPD_SIGNING_KEY`` is set, which then signs), and
  every one is accepted. Rotation: put the new key first and keep the old one below it
  until no snapshot signed with it is needed.
A key is at least :data:`MIN_KEY_BYTES` bytes. Without any key nothing is signed or
checked, as before.

What is signed (format v5, header flag ``SIGNED``): a trailer after the payload, the
key's id (8 bytes: the first 8 of the HMAC-SHA-256 of a fixed label under the key, so
the id says which key without telling anything of it) and the HMAC-SHA-256 of every
byte before the trailer (header included). A client with a key refuses, as
:class:`~snapd.errors.UntrustedSnapshot` naming the file, a manifest or record that is
unsigned, signed with a key it does not accept, or whose HMAC does not match; restore
falls back to the newest correctly signed snapshot.

One daemon signs for every client of its root, with the key it was started with, so
a client that joins a running daemon says in its hello the id of the key it signs
with ("" for none; never the key) and the daemon refuses it (OptionMismatch) when
its own differs (:func:`check_same_signer`): a trainer given a key would otherwise
leave snapshots that it refuses itself, unsigned or signed with another key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from typing import List, Mapping, Optional

from snapd import format as fmt
from snapd.errors import InvalidOption, OptionMismatch, ProtocolError, UntrustedSnapshot

KEY_VARIABLE = "SNAPD_SIGNING_KEY"
MIN_KEY_BYTES = 16
_ID_LABEL = b"snapd signing key id"
_KEY_ID_HEX = re.compile(f"[0-9a-f]{{{2 * fmt.KEY_ID_BYTES}}}")


def key_id(key: bytes) -> bytes:
    return hmac.new(key, _ID_LABEL, hashlib.sha256).digest()[:fmt.KEY_ID_BYTES]


class Keys:
    """The key that signs (None: this process only checks) and the keys accepted."""

    def __init__(self, signer: Optional[bytes], accepted: List[bytes]) -> None:
        self.signer = signer
        self.accepted = {key_id(k): k for k in accepted}
        if signer is not None:
            self.accepted.setdefault(key_id(signer), signer)

    @property
    def ids(self) -> List[str]:
        return [k.hex() for k in self.accepted]

    def signature(self, signed: bytes) -> bytes:
        """The trailer of a file whose bytes before it are ``signed``."""
        assert self.signer is not None
        return key_id(self.signer) + hmac.new(self.signer, signed, hashlib.sha256).digest()

    def check(self, data: bytes, *, path: str, what: str) -> None:
        """``data`` (a decoded manifest's or record's bytes) is signed with an accepted
        key, and its HMAC matches; UntrustedSnapshot otherwise."""
        found = fmt.signature_of(data)
        if found is None:
            raise UntrustedSnapshot(
                f"{path}: the {what} is not signed, and this client has a signing key "
                f"(accepted key ids {self.ids}): anyone who can write the root or the "
                "bucket could have written it. Restore uses the newest correctly "
                "signed snapshot; give the daemon that writes snapshots the key "
                f"({KEY_VARIABLE} or signing_key_file) so that new ones are signed",
                path=path, field="signature")
        kid, mac, signed = found
        key = self.accepted.get(kid)
        if key is None:
            raise UntrustedSnapshot(
                f"{path}: the {what} is signed with key id {kid.hex()}, which this client "
                f"does not accept (accepted: {self.ids}). If that key is yours (an old "
                "one, rotated out), list it in signing_key_file below the signing key",
                path=path, field="signature")
        if not hmac.compare_digest(mac, hmac.new(key, signed, hashlib.sha256).digest()):
            raise UntrustedSnapshot(
                f"{path}: the {what}'s signature (key id {kid.hex()}) does not match its "
                "bytes: it was changed after it was signed. Treat it as forged; restore "
                "uses an older snapshot", path=path, field="signature")


def signer_id(keys: Optional[Keys]) -> str:
    """The id (hex) of the key that signs, "" when nothing is signed: what a hello
    carries and a daemon compares (the key itself never leaves the process)."""
    return "" if keys is None or keys.signer is None else key_id(keys.signer).hex()


def check_same_signer(own: str, given: object, root: str) -> None:
    """Refuse (OptionMismatch, field ``signing_key``) a client whose signing key id
    ``given`` is not the daemon's ``own`` (:func:`signer_id` of each). ``given`` None:
    a client that sends none (a tool, an older client) is never refused."""
    if given is None:
        return
    if not isinstance(given, str) or (given and not _KEY_ID_HEX.fullmatch(given)):
        raise ProtocolError(f"hello signing_key_id must be \"\" or a key id of "
                            f"{2 * fmt.KEY_ID_BYTES} hex digits, got {given!r:.40}",
                            field="signing_key_id")
    if given == own:
        return
    daemon = f"signs with key id {own}" if own else "signs nothing (it has no key)"
    client = f"this client's key has id {given}" if given else "this client has no key"
    raise OptionMismatch(
        f"the daemon serving {root} {daemon}, but {client}: one daemon signs every "
        "snapshot of its root with the key it was started with (key ids are compared; "
        f"a key is never sent). Give the client the daemon's key ({KEY_VARIABLE} or "
        f"signing_key_file), or stop the daemon (`snapd stop {root}`) and start the "
        "trainer again: it starts a daemon with the client's key",
        path=root, field="signing_key")


def load_keys(key_file: Optional[str], environ: Optional[Mapping[str, str]] = None
              ) -> Optional[Keys]:
    """The keys of this process (module docstring), or None when it has none.
    InvalidOption naming the variable or the file when a key is unusable."""
    env = os.environ if environ is None else environ
    signer = _key(env[KEY_VARIABLE], KEY_VARIABLE) if env.get(KEY_VARIABLE) else None
    from_file: List[bytes] = []
    if key_file:
        try:
            with open(key_file, "rb") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise InvalidOption(f"signing_key_file={key_file!r}: cannot be read "
                                f"({e.strerror}); give a file of keys, one per line",
                                path=key_file, field="signing_key_file") from e
        from_file = [_key(line.strip(), f"{key_file} line {i + 1}")
                     for i, line in enumerate(lines) if line.strip()]
        if not from_file:
            raise InvalidOption(f"signing_key_file={key_file!r} holds no key; write one "
                                "key per line, the signing one first", path=key_file,
                                field="signing_key_file")
    if signer is None and not from_file:
        return None
    return Keys(signer if signer is not None else from_file[0], from_file)


def _key(text, where: str) -> bytes:
    key = text.encode() if isinstance(text, str) else bytes(text)
    if len(key) < MIN_KEY_BYTES:
        raise InvalidOption(f"{where}: a signing key of {len(key)} bytes is too short to "
                            f"keep anyone out; use at least {MIN_KEY_BYTES} random bytes "
                            "(e.g. `openssl rand -hex 32`)", field="signing_key")
    return key
