"""`hlat compare RUN... --out FILE.png`: the loss and gradient-norm curves of runs overlaid (and the validation
loss of each validation set the runs logged: val_loss, and val_NAME_loss of each named set of eval.sets, a panel
each), and how far each run deviates from the first.

Deviation of a run from the reference (the first run), per metric: |x - x_ref| / |x_ref| at every step both
logged a finite value, so runs of different lengths or log intervals are compared where they meet; the table
gives its maximum and mean. A logged value is the mean over the log interval ending at that step (for the
gradient norm, `grad_norm_mean`; runs from before it existed give their last step's `grad_norm`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from hlat import HlatError
from hlat.files import read_metrics

TRAINING = {"loss": "training loss", "grad_norm": "gradient norm"}
VALIDATION = re.compile(r"val_(?:([a-z0-9_]+)_)?loss")  # val_loss, and val_NAME_loss of a named set


@dataclass
class Run:
    label: str
    series: dict[str, dict[int, float]]  # metric -> step -> finite value


def title(metric: str) -> str:
    """A metric's name in words: 'training loss', 'validation loss: code'."""
    if metric in TRAINING:
        return TRAINING[metric]
    name = VALIDATION.fullmatch(metric)[1]
    return f"validation loss: {name}" if name else "validation loss"


def metrics(runs: list[Run]) -> list[str]:
    """The metrics to compare: the training ones, then every validation set any run logged (val_loss first)."""
    logged = {m for run in runs for m, points in run.series.items() if points}
    return [*TRAINING, *sorted(logged - TRAINING.keys(), key=lambda m: (m != "val_loss", m))]


def _value(record: dict, metric: str):
    if metric == "grad_norm":
        return record.get("grad_norm_mean", record.get("grad_norm"))
    return record.get(metric)


def read_run(path: str | Path, label: str) -> Run:
    path = Path(path)
    metrics = path / "metrics.jsonl" if path.is_dir() else path
    if not metrics.is_file():
        raise HlatError(f"{path}: no metrics.jsonl (give a run directory or a metrics.jsonl file)")
    series: dict[str, dict[int, float]] = {m: {} for m in TRAINING}
    for record in read_metrics(metrics):
        for metric in [*TRAINING, *(key for key in record if VALIDATION.fullmatch(key))]:
            value = _value(record, metric)
            if isinstance(value, (int, float)) and math.isfinite(value):
                series.setdefault(metric, {})[record["step"]] = float(value)
    if not series["loss"]:
        raise HlatError(f"{metrics}: no logged loss")
    return Run(label, series)


def deviations(reference: Run, run: Run) -> dict:
    """{metric: {"steps", "max", "mean"}} of the relative deviation of `run` from `reference`."""
    out = {}
    for metric in metrics([reference, run]):
        ref, other = reference.series.get(metric, {}), run.series.get(metric, {})
        steps = sorted(s for s in ref.keys() & other.keys() if ref[s] != 0)
        if not steps:
            continue
        rel = [abs(other[s] - ref[s]) / abs(ref[s]) for s in steps]
        out[metric] = {"steps": len(steps), "max": max(rel), "mean": sum(rel) / len(rel)}
    return out


def plot(runs: list[Run], out: Path) -> list[str]:
    """Draw a panel per metric any run logged into `out`; the panels' titles."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    shown = [m for m in metrics(runs) if any(r.series.get(m) for r in runs)]
    fig, axes = plt.subplots(1, len(shown), figsize=(5.5 * len(shown), 4), squeeze=False)
    for ax, metric in zip(axes[0], shown):
        for run in runs:
            points = sorted(run.series.get(metric, {}).items())
            if points:
                ax.plot(*zip(*points), label=run.label, lw=1.2, marker="o" if len(points) < 20 else None, ms=3)
        ax.set_xlabel("step")
        ax.set_title(title(metric))
        if metric == "grad_norm":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return [title(m) for m in shown]
