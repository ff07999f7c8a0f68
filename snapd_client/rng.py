"""Capture, digest and restore every random-number stream of the training process.

A *stream* is one independent generator whose position decides what the run does
next. snapd knows these streams:

=============  ===============================================================
name           what
=============  ===============================================================
``python``     the ``random`` module's Mersenne Twister
``numpy``      NumPy's legacy global generator (``np.random.*``)
``torch``      torch's default CPU generator
``cuda:N``     the default generator of CUDA device N (when CUDA is present)
``gen:NAME``   a private ``torch.Generator`` (a loader's, or one the user tracks)
=============  ===============================================================

Each stream's state is encoded as one ``bytes`` value, so a state is a plain
``dict[str, bytes]``: msgpack carries it without pickle, and a digest of a stream is
the xxh3-64 of its bytes. Encodings are part of the on-disk format (docs/format.md).
"""

from __future__ import annotations

import ctypes
import random
import struct
from typing import Dict, Iterable, Mapping

import numpy as np
import torch
import xxhash

from snapd.errors import CorruptSnapshot, IncompatibleState, InvalidOption, MissingRngStream

RngState = Dict[str, bytes]

# Streams every snapshot holds (the writer always captures them): one missing means
# damage. A CUDA stream or a private generator may be absent for good reasons (fewer
# devices then, a generator tracked since), and then absent from every snapshot.
ALWAYS = ("python", "numpy", "torch")

# random.getstate() is (3, 625 uint32 words, gauss_next): the words are the MT state
# plus its index, gauss_next is None or a float.
_PY_WORDS = 625
_PY_FORMAT = f"<I{_PY_WORDS}I?d"
# np.random.get_state() is ('MT19937', 624 uint32 keys, pos, has_gauss, cached_gaussian).
_NP_KEYS = 624
_NP_FORMAT = f"<{_NP_KEYS}Iiid"


def _encode_python(state) -> bytes:
    version, words, gauss = state
    return struct.pack(_PY_FORMAT, version, *words, gauss is not None, gauss or 0.0)


def _decode_python(blob: bytes):
    values = struct.unpack(_PY_FORMAT, blob)
    version, words, has_gauss, gauss = values[0], values[1:-2], values[-2], values[-1]
    return (version, tuple(words), gauss if has_gauss else None)


def _encode_numpy(state) -> bytes:
    kind, keys, pos, has_gauss, gauss = state
    if kind != "MT19937":
        raise IncompatibleState(f"numpy global generator is {kind!r}; snapd saves MT19937 only",
                                field="rng.numpy")
    return struct.pack(_NP_FORMAT, *keys.tolist(), pos, has_gauss, gauss)


def _decode_numpy(blob: bytes):
    values = struct.unpack(_NP_FORMAT, blob)
    keys = np.array(values[:_NP_KEYS], dtype=np.uint32)
    pos, has_gauss, gauss = values[_NP_KEYS:]
    return ("MT19937", keys, pos, has_gauss, gauss)


def _tensor_bytes(state: torch.Tensor) -> bytes:
    return state.cpu().numpy().tobytes()


def _bytes_tensor(blob: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


# The numpy digest covers the MT19937 keys and position only (the first 2500 bytes of
# its encoding), which is exactly the generator's C state: the per-step digest reads
# it in place (1 us) instead of through np.random.get_state() (70 us).
_NP_DIGEST_BYTES = _NP_KEYS * 4 + 4


def digest(name: str, blob: bytes) -> int:
    """The xxh3-64 digest of one stream's encoded state: what the state log records."""
    if name == "numpy":
        return xxhash.xxh3_64_intdigest(memoryview(blob)[:_NP_DIGEST_BYTES])
    return xxhash.xxh3_64_intdigest(blob)


def _numpy_state_address() -> int | None:
    """Address of the global MT19937 state, when this numpy exposes it (and is LE)."""
    try:
        import sys
        bit_generator = np.random.mtrand._rand._bit_generator
        if sys.byteorder != "little" or type(bit_generator).__name__ != "MT19937":
            return None
        return bit_generator.ctypes.state_address
    except AttributeError:
        return None


class RngStreams:
    """The set of streams of one training process, with capture and restore.

    The global streams are always present; CUDA streams when CUDA is available;
    private generators once registered with :meth:`add_generator`.
    """

    def __init__(self) -> None:
        self._generators: Dict[str, torch.Generator] = {}

    def add_generator(self, name: str, generator: torch.Generator) -> None:
        """Register a private generator as stream ``gen:<name>``."""
        key = f"gen:{name}"
        known = self._generators.get(key)
        if known is not None and known is not generator:
            raise InvalidOption(f"a different generator is already tracked as {key!r}; "
                                "give each generator its own name", field=key)
        self._generators[key] = generator

    def names(self) -> list[str]:
        """Stream names present in this process now, in a stable order."""
        names = ["python", "numpy", "torch"]
        if torch.cuda.is_available():
            names += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        return names + sorted(self._generators)

    def capture(self) -> RngState:
        """Every stream's state at this instant."""
        state: RngState = {
            "python": _encode_python(random.getstate()),
            "numpy": _encode_numpy(np.random.get_state()),
            "torch": _tensor_bytes(torch.get_rng_state()),
        }
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                state[f"cuda:{i}"] = _tensor_bytes(torch.cuda.get_rng_state(i))
        for key, gen in sorted(self._generators.items()):
            state[key] = _tensor_bytes(gen.get_state())
        return state

    def check(self, state: Mapping[str, bytes], *, source: str, prefix: str = "rng",
              omit: Iterable[str] = ()) -> None:
        """Refuse a saved state that lacks a stream this process has, or holds one
        that its generator would not take back (wrong length, impossible position).

        Each stream is put into a scratch generator of its kind, never a live one;
        all before anything is restored. A damaged stream raises CorruptSnapshot; a
        CUDA or private-generator stream the state lacks, MissingRngStream. ``prefix``
        is the field the state lies under; streams in ``omit`` are not checked.
        Streams the state has and this process lacks are ignored (docs/operations.md).
        """
        if not isinstance(state, Mapping):
            raise CorruptSnapshot(f"{source}: field {prefix} is not a map of streams",
                                  path=source, field=prefix)
        skip = set(omit)
        names = [n for n in self.names() if n not in skip]
        missing = [n for n in names if n not in state]
        if missing:
            raise _missing(missing, state, source, prefix)
        for name in names:
            blob, field = state[name], f"{prefix}.{name}"
            if not isinstance(blob, (bytes, bytearray)):
                raise CorruptSnapshot(f"{source}: field {field} is not bytes",
                                      path=source, field=field)
            try:
                self._try_state(name, bytes(blob))
            except Exception as e:  # struct, numpy and torch each raise their own
                raise CorruptSnapshot(
                    f"{source}: field {field} ({len(blob)} bytes) is not a state the "
                    f"{name!r} generator accepts ({e}); the snapshot is damaged or "
                    "hostile, use an older one", path=source, field=field) from e

    def _try_state(self, name: str, blob: bytes) -> None:
        """Load ``blob`` into a new generator of the stream's kind; raises if refused."""
        if name == "python":
            random.Random().setstate(_decode_python(blob))
        elif name == "numpy":
            np.random.RandomState().set_state(_decode_numpy(blob))
        elif name.startswith("cuda:"):
            expected = torch.cuda.get_rng_state(int(name.split(":", 1)[1])).numel()
            if len(blob) != expected:
                raise ValueError(f"{expected} bytes expected")
        else:
            live = torch.get_rng_state() if name == "torch" else \
                self._generators[name].get_state()
            if len(blob) != live.numel():
                raise ValueError(f"{live.numel()} bytes expected")
            torch.Generator().set_state(_bytes_tensor(blob))

    def restore(self, state: Mapping[str, bytes], *, omit: Iterable[str] = ()) -> None:
        """Put every stream back. ``omit`` leaves named streams as they are (test hook)."""
        skip = set(omit)
        for name in self.names():
            if name in skip or name not in state:
                continue
            blob = bytes(state[name])
            if name == "python":
                random.setstate(_decode_python(blob))
            elif name == "numpy":
                np.random.set_state(_decode_numpy(blob))
            elif name == "torch":
                torch.set_rng_state(_bytes_tensor(blob))
            elif name.startswith("cuda:"):
                torch.cuda.set_rng_state(_bytes_tensor(blob), int(name.split(":", 1)[1]))
            else:
                self._generators[name].set_state(_bytes_tensor(blob))

    def digests(self, state: Mapping[str, bytes]) -> Dict[str, int]:
        """The digest of each stream of a captured state."""
        return {name: digest(name, bytes(blob)) for name, blob in state.items()}

    def live_digests(self) -> Dict[str, int]:
        """The digest of each live stream, cheaply enough to take at every step."""
        out = {"python": digest("python", _encode_python(random.getstate()))}
        address = _numpy_state_address()
        if address is None:
            out["numpy"] = digest("numpy", _encode_numpy(np.random.get_state()))
        else:
            out["numpy"] = xxhash.xxh3_64_intdigest(ctypes.string_at(address,
                                                                     _NP_DIGEST_BYTES))
        out["torch"] = digest("torch", torch.get_rng_state().numpy())
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                out[f"cuda:{i}"] = digest("cuda", torch.cuda.get_rng_state(i).numpy())
        for key, gen in sorted(self._generators.items()):
            out[key] = digest(key, gen.get_state().numpy())
        return out


def _missing(names: list[str], state: Mapping[str, bytes], source: str,
             prefix: str) -> Exception:
    """The error for streams this process has and the saved state lacks."""
    field = f"{prefix}.{names[0]}"
    damaged = [n for n in names if n in ALWAYS]
    if damaged:   # the writer always saves these: the snapshot is damaged
        return CorruptSnapshot(
            f"{source}: field {prefix}.{damaged[0]} is missing; this snapshot cannot "
            f"restore the {damaged[0]!r} random stream. Use an older snapshot, or "
            "restore(mode='warm_start') to load weights only",
            path=source, field=f"{prefix}.{damaged[0]}")
    fixes = []
    if any(n.startswith("cuda:") for n in names):
        saved = sum(1 for k in state if str(k).startswith("cuda:"))
        fixes.append(f"it was taken with {saved} CUDA device(s) visible: set "
                     f"CUDA_VISIBLE_DEVICES to {saved} device(s)"
                     + (" ('' for none)" if saved == 0 else "") + " to resume exactly")
    if any(n.startswith("gen:") for n in names):
        fixes.append("a generator tracked now was not tracked then: stop tracking it "
                     "to resume exactly")
    omit = ", ".join(repr(f"rng:{n}") for n in names)
    return MissingRngStream(
        f"{source}: field {prefix} has no {', '.join(names)} stream, which this "
        f"process has. No older snapshot is tried (they come from the same setup, and "
        "would lose the steps since): "
        + "; ".join(fixes) + f"; or restore(_omit=[{omit}]) to resume with the stream "
        "as it is now (recomputed steps then differ from the log there: replay_check="
        "'warn'), or restore(mode='warm_start') to load weights only",
        path=source, field=field)
