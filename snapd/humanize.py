"""How snapd writes numbers, sizes, times and lineages for people: one home.

The operator commands (snapd/commands/) and the live view (snapd/liveview.py) show
the same quantities; spelling them in one place keeps ``ls``, ``inspect``,
``status`` and ``watch`` agreeing. Pure functions of plain values, no I/O.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Dict, Optional

__all__ = ["age", "count", "human_bytes", "iso_time", "lineage_text", "number", "si_bytes",
           "span"]


def age(seconds: Optional[float]) -> str:
    """``42s``, ``3.5m``, ``1.2h``, ``2.0d``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def span(seconds: Optional[float]) -> str:
    """A duration where tenths matter below ten seconds: ``0.4s``, ``3.4s``, then as
    :func:`age` (``12s``, ``3.5m``, ``1.2h``); ``-`` when unknown."""
    if seconds is None:
        return "-"
    return f"{max(0.0, seconds):.1f}s" if seconds < 9.95 else age(seconds)


def count(n: Any, word: str, many: Optional[str] = None) -> str:
    """``1 update``, ``2 updates``, ``0 updates``: a count with its noun agreeing;
    ``many`` spells an irregular plural (``count(n, "batch", "batches")``)."""
    return f"{n} {word if n == 1 else many or word + 's'}"


def human_bytes(n: Optional[int]) -> str:
    """Binary units, as file sizes are listed: ``512 B``, ``1.5 MiB``."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def si_bytes(n: Optional[float]) -> str:
    """Decimal units, as disks are sold and rates read: ``1.5 GB``, ``12.0 MB``."""
    if n is None:
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def number(v: Any, fmt: str = "{:.4g}") -> str:
    """A value in ``fmt``, or ``-`` when there is none."""
    return "-" if v is None else fmt.format(v)


def iso_time(t: Optional[float]) -> Optional[str]:
    """A Unix time as local ISO 8601 to the second, with its offset."""
    if t is None:
        return None
    return datetime.fromtimestamp(t, tz=timezone.utc).astimezone().isoformat(
        timespec="seconds")


def lineage_text(lineage: Optional[Dict[str, Any]], run: Optional[str] = None) -> str:
    """``0`` for a fresh run; ``1 warm_start from gpt/00001200`` for a warm start, or
    ``1 from 00001200`` when ``run`` (the row's own run) is the parent's: short form."""
    lineage = lineage or {}
    text = str(lineage.get("id", 0))
    parent = lineage.get("parent")
    if run is None and lineage.get("mode") and lineage.get("mode") != "fresh":
        text += f" {lineage['mode']}"
    if parent:
        where = parent.get("snapshot") if run is not None and parent.get("run") == run \
            else f"{parent.get('run')}/{parent.get('snapshot')}"
        text += f" from {where}"
    return text
