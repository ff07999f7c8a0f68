"""``snapd plot RUN -o loss.png``: a scalar over steps, from the state log alone.

Each ``"step"`` record carries the scalars ``Client.log`` was given. A step recomputed
after a resume appears twice in the log; the newest record wins (the log is read
oldest first, so later records replace earlier ones). A warm start begins a new
lineage at step 0, so steps are keyed by (lineage, step) and each lineage is its own
line. Committed snapshots are drawn as vertical lines, resumes as markers.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import click

from snapd import statelog
from snapd.commands.common import (ROOT_HELP, emit_json, fail, optional_import,
                                   resolve_root, run_dir)
from snapd.errors import CorruptLog
from snapd.store import SnapshotId
from snapd.humanize import count


def series(path: str, rank: int, scalar: str) -> Dict[str, Any]:
    """Points per lineage, snapshot and resume marks, as plain data."""
    lineage = 0
    points: Dict[Tuple[int, int], float] = {}
    seen: set = set()
    snapshots: List[Dict[str, Any]] = []
    resumes: List[Dict[str, Any]] = []
    for record in statelog.read_records(path, rank):
        kind = record.get("kind")
        if kind == "resume":
            lineage = int((record.get("lineage") or {}).get("id", lineage))
            resumes.append({"lineage": lineage, "step": record.get("step"),
                            "mode": record.get("mode"), "snapshot": record.get("snapshot")})
        elif kind == "step":
            scalars = record.get("scalars") or {}
            seen.update(scalars)
            if scalar in scalars:
                points[(lineage, record["step"])] = float(scalars[scalar])
        elif kind == "snapshot" and record.get("event") == "committed":
            sid = SnapshotId.parse(str(record.get("name")))
            snapshots.append({"lineage": sid.lineage if sid else lineage,
                              "step": record.get("step"), "name": record.get("name")})
    lines: Dict[int, List[Tuple[int, float]]] = {}
    for (lin, step), value in sorted(points.items()):
        lines.setdefault(lin, []).append((step, value))
    return {"scalar": scalar, "scalars_logged": sorted(seen), "lines": lines,
            "snapshots": snapshots, "resumes": resumes}


def draw(data: Dict[str, Any], run: str, output: str) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only: never a display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    several = len(data["lines"]) > 1
    for lin, pts in data["lines"].items():
        label = f"{data['scalar']} (lineage {lin})" if several else data["scalar"]
        ax.plot([s for s, _ in pts], [v for _, v in pts], linewidth=1.2, label=label)
    for i, snap in enumerate(data["snapshots"]):
        ax.axvline(snap["step"], color="tab:green", alpha=0.35, linewidth=0.8,
                   linestyle="--", label="snapshot committed" if i == 0 else None)
    values = {(lin, s): v for lin, pts in data["lines"].items() for s, v in pts}
    for i, res in enumerate(data["resumes"]):
        y = values.get((res["lineage"], res["step"]))
        if y is None:
            ax.axvline(res["step"], color="tab:red", linewidth=1.0,
                       label="resume" if i == 0 else None)
        else:
            ax.plot([res["step"]], [y], marker="v", markersize=9, color="tab:red",
                    linestyle="none", label="resume" if i == 0 else None)
        ax.annotate(f"{res['mode']} from {res['snapshot']}", (res["step"], y or 0),
                    xycoords=("data", "axes fraction") if y is None else "data",
                    textcoords="offset points", xytext=(4, 8), fontsize=7, color="tab:red")
    ax.set_xlabel("step (completed optimizer updates)")
    ax.set_ylabel(data["scalar"])
    ax.set_title(f"{run}: {data['scalar']} per step")
    ax.grid(alpha=0.25)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(output, format="png")
    plt.close(fig)


@click.command()
@click.argument("run")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="The PNG file to write.")
@click.option("--scalar", default="loss", show_default=True,
              help="Which logged scalar to plot (Client.log(step, NAME=value)).")
@click.option("--rank", type=int, default=0, show_default=True)
@click.option("--root", help=ROOT_HELP)
@click.option("--json", "as_json", is_flag=True,
              help="Also print the plotted points and marks as JSON.")
def plot(run: str, output: str, scalar: str, rank: int, root: Optional[str],
         as_json: bool) -> None:
    """Plot a logged scalar of RUN over steps (newest record of a replayed step),
    with committed snapshots and resumes marked. Reads only the state log.

    Example: snapd plot gpt-small -o loss.png --root checkpoints --scalar loss
    """
    optional_import("matplotlib", "plot", "plot")   # before any work: say what is missing
    path = run_dir(resolve_root(root), run)
    if rank not in statelog.list_ranks(path):
        fail(f"{os.path.join(path, 'log', f'rank-{rank:05d}')}: no state log for rank "
             f"{rank}; ranks logged: {statelog.list_ranks(path) or 'none'}", 2)
    try:
        data = series(path, rank, scalar)
    except CorruptLog as e:
        fail(f"{e}\n  hint: a segment header is damaged; move that segment aside", 1)
    if not data["lines"]:
        fail(f"{path}: no step record of rank {rank} logs {scalar!r}; scalars logged: "
             f"{', '.join(data['scalars_logged']) or 'none'} (use --scalar NAME)", 1)
    output = os.path.abspath(output)
    if not os.path.isdir(os.path.dirname(output)):
        fail(f"{os.path.dirname(output)}: no such directory for -o {output}", 2)
    draw(data, run, output)
    if as_json:
        emit_json({**data, "lines": {str(k): v for k, v in data["lines"].items()},
                   "output": output})
    else:
        points = sum(len(p) for p in data["lines"].values())
        snaps, resumes = len(data["snapshots"]), len(data["resumes"])
        click.echo(f"wrote {output}: {count(points, 'step')} of {scalar}, "
                   f"{count(snaps, 'snapshot')} committed, {count(resumes, 'resume')}")
