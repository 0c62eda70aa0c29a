"""`hlat compare RUN... --out FILE.png`: the loss and gradient-norm curves of runs overlaid (validation loss too
when the runs logged it), and how far each run deviates from the first.

Deviation of a run from the reference (the first run), per metric: |x - x_ref| / |x_ref| at every step both
logged a finite value, so runs of different lengths or log intervals are compared where they meet; the table
gives its maximum and mean. A logged value is the mean over the log interval ending at that step (for the
gradient norm, `grad_norm_mean`; runs from before it existed give their last step's `grad_norm`).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from hlat import HlatError

METRICS = {"loss": "training loss", "grad_norm": "gradient norm", "val_loss": "validation loss"}


@dataclass
class Run:
    label: str
    series: dict[str, dict[int, float]]  # metric -> step -> finite value


def _value(record: dict, metric: str):
    if metric == "grad_norm":
        return record.get("grad_norm_mean", record.get("grad_norm"))
    return record.get(metric)


def read_run(path: str | Path, label: str) -> Run:
    path = Path(path)
    metrics = path / "metrics.jsonl" if path.is_dir() else path
    if not metrics.is_file():
        raise HlatError(f"{path}: no metrics.jsonl (give a run directory or a metrics.jsonl file)")
    series: dict[str, dict[int, float]] = {m: {} for m in METRICS}
    for n, line in enumerate(metrics.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise HlatError(f"{metrics}:{n}: not a metrics record") from None
        for metric in METRICS:
            value = _value(record, metric)
            if isinstance(value, (int, float)) and math.isfinite(value):
                series[metric][step] = float(value)
    if not series["loss"]:
        raise HlatError(f"{metrics}: no logged loss")
    return Run(label, series)


def deviations(reference: Run, run: Run) -> dict:
    """{metric: {"steps", "max", "mean"}} of the relative deviation of `run` from `reference`."""
    out = {}
    for metric in METRICS:
        ref, other = reference.series[metric], run.series[metric]
        steps = sorted(s for s in ref.keys() & other.keys() if ref[s] != 0)
        if not steps:
            continue
        rel = [abs(other[s] - ref[s]) / abs(ref[s]) for s in steps]
        out[metric] = {"steps": len(steps), "max": max(rel), "mean": sum(rel) / len(rel)}
    return out


def plot(runs: list[Run], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    shown = [m for m in METRICS if any(r.series[m] for r in runs)]
    fig, axes = plt.subplots(1, len(shown), figsize=(5.5 * len(shown), 4), squeeze=False)
    for ax, metric in zip(axes[0], shown):
        for run in runs:
            points = sorted(run.series[metric].items())
            if points:
                ax.plot(*zip(*points), label=run.label, lw=1.2, marker="o" if len(points) < 20 else None, ms=3)
        ax.set_xlabel("step")
        ax.set_title(METRICS[metric])
        if metric == "grad_norm":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="run directories (or metrics.jsonl files); the first is the reference")
    p.add_argument("--out", help="PNG file for the overlaid curves")
    p.add_argument("--labels", help="comma-separated names for the runs (default: their directory names)")
    p.add_argument("--json", action="store_true", help="print the deviations as JSON")


def run(args: argparse.Namespace) -> int:
    labels = args.labels.split(",") if args.labels else [Path(r).name or str(r) for r in args.runs]
    if len(labels) != len(args.runs):
        raise HlatError(f"--labels: {len(labels)} names for {len(args.runs)} runs")
    runs = [read_run(path, label) for path, label in zip(args.runs, labels)]
    if args.out:
        if Path(args.out).suffix.lower() != ".png":
            raise HlatError(f"--out: {args.out} should be a .png file")
        plot(runs, Path(args.out))
    table = [{"run": r.label, "reference": runs[0].label, **deviations(runs[0], r)} for r in runs[1:]]
    if args.json:
        print(json.dumps({"runs": labels, "deviations": table, "figure": args.out}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    out = Table(title=f"relative deviation from {runs[0].label} over the steps both logged")
    out.add_column("run")
    for metric in METRICS:
        out.add_column(f"{metric} max", justify="right")
        out.add_column(f"{metric} mean", justify="right")
    out.add_column("steps", justify="right")
    for row in table:
        cells = [f"{row[m]['max']:.2%}" if m in row else "-" for m in METRICS]
        means = [f"{row[m]['mean']:.2%}" if m in row else "-" for m in METRICS]
        steps = row["loss"]["steps"] if "loss" in row else 0
        out.add_row(row["run"], *[c for pair in zip(cells, means) for c in pair], str(steps))
    console = Console()
    console.print(out)
    if len(runs) == 1:
        console.print("one run: nothing to compare it with")
    if args.out:
        console.print(f"wrote {args.out}")
    return 0
