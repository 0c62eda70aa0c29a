"""Calibration: fitting a profile's efficiency factors (`Fit`) to measured step times.

The step-time model is piecewise linear in those factors (see `hlat.planner.timing`), so fitting them is a short
series of small non-negative least-squares problems on relative errors, each solved exactly without numpy.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from hlat import HlatError
from hlat.fields import load_toml
from hlat.files import read_metrics
from hlat.planner.layout import Layout, Workload
from hlat.planner.timing import step_time
from hlat.profiles import FACTORS, Fit, HardwareProfile


@dataclass(frozen=True)
class Sample:
    """One measured step: what ran, where, and how long it took."""

    name: str
    workload: Workload
    layout: Layout
    hardware: HardwareProfile
    step_s: float
    group: str = ""


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solve the square system a x = b by Gaussian elimination with partial pivoting (None if singular)."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def nnls(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Non-negative least squares for a handful of unknowns: the best unconstrained solution over every subset of
    free variables whose solution is non-negative (exact, and cheap for up to ~8 unknowns)."""
    n = len(rows[0])
    best, best_err = [0.0] * n, sum(t * t for t in targets)
    for size in range(1, n + 1):
        for subset in itertools.combinations(range(n), size):
            ata = [[sum(r[i] * r[j] for r in rows) for j in subset] for i in subset]
            atb = [sum(r[i] * t for r, t in zip(rows, targets)) for i in subset]
            sol = _solve(ata, atb)
            if sol is None or min(sol) < 0:
                continue
            x = [0.0] * n
            for i, v in zip(subset, sol):
                x[i] = v
            err = sum((sum(c * v for c, v in zip(r, x)) - t) ** 2 for r, t in zip(rows, targets))
            if err < best_err:
                best, best_err = x, err
    return best


# Nothing runs faster than its nominal peak: these factors are fitted as 1 + a non-negative excess.
FLOORS = {"flops_factor": 1.0, "intra_factor": 1.0, "inter_factor": 1.0}


def fit_factors(
    samples: list[Sample],
    free: tuple[str, ...],
    base: Fit,
    source: str,
    weights: list[float] | None = None,
    rounds: int = 30,
) -> Fit:
    """Fit the `free` factors of `base` to the samples, minimising the (weighted) squared relative error of the
    step time; the other factors keep their values from `base`. The model is linear in the factors wherever each
    layer stays host- or device-bound, so each round solves the linear problem around the current factors and
    the next round re-linearises, until the factors no longer move."""
    if not samples:
        raise HlatError("calibration: no measurements to fit")
    unknown = set(free) - set(FACTORS)
    if unknown:
        raise HlatError(f"calibration: unknown factors {sorted(unknown)} (known: {', '.join(FACTORS)})")
    weights = weights or [1.0] * len(samples)

    def objective(x: dict[str, float]) -> float:
        current = replace(base, **x)
        return sum(
            w * (step_time(s.workload, s.layout, s.hardware, current).total / s.step_s - 1) ** 2
            for s, w in zip(samples, weights)
        )

    def descend(x: dict[str, float]) -> tuple[float, dict[str, float]]:
        best = objective(x)
        for _ in range(rounds):
            current = replace(base, **x)
            rows, targets = _linearised(samples, weights, free, current, x)
            step = {k: FLOORS.get(k, 0.0) + e - x[k] for k, e in zip(free, nnls(rows, targets))}
            for _ in range(20):  # the linear model holds only near x: halve the step until the error falls
                new = {k: x[k] + step[k] for k in free}
                error = objective(new)
                if error < best:
                    break
                step = {k: v / 2 for k, v in step.items()}
            else:
                break
            moved = max(abs(v) for v in step.values())
            x, best = new, error
            if moved < 1e-6:
                break
        return best, x

    # Each start has every factor positive (at a zero overhead no layer is host-bound and its slope would stay 0);
    # a start far above and one near the floors reach the pieces of either regime.
    _, x = min(
        (descend({k: FLOORS.get(k, 0.0) + start for k in free}) for start in (1.0, 10.0)), key=lambda result: result[0]
    )
    return replace(base, source=source, **{k: round(v, 4) for k, v in x.items()})


def _linearised(
    samples: list[Sample], weights: list[float], free: tuple[str, ...], current: Fit, x: dict[str, float]
) -> tuple[list[list[float]], list[float]]:
    """The step times around the factors `x` (of `current`) as a linear least-squares problem in the factors'
    excess over their floors: one weighted, relative row and target per sample."""
    rows, targets = [], []
    for s, w in zip(samples, weights):
        t0 = step_time(s.workload, s.layout, s.hardware, current).total
        # Slopes by finite differences: exact within a linear piece.
        slopes = [
            (step_time(s.workload, s.layout, s.hardware, replace(current, **{k: x[k] + 1e-3})).total - t0) / 1e-3
            for k in free
        ]
        scale = w**0.5 / s.step_s
        rows.append([c * scale for c in slopes])
        # t = t0 + slopes . (x' - x), solved for the excess x' - floor >= 0.
        rest = t0 - sum(c * (x[k] - FLOORS.get(k, 0.0)) for c, k in zip(slopes, free))
        targets.append((s.step_s - rest) * scale)
    return rows, targets


def read_run(run_dir: str | Path, skip: int = 1) -> tuple[dict, float]:
    """The resolved config and the median step time of an hlat run directory (config.toml + metrics.jsonl).
    The first `skip` logged intervals are dropped: they include compilation and warm-up."""
    run = Path(run_dir)
    metrics = run / "metrics.jsonl"
    if not (metrics.is_file() and (run / "config.toml").is_file()):
        raise HlatError(f"--calibrate: {run} is not an hlat run directory (needs config.toml and metrics.jsonl)")
    config = load_toml(run / "config.toml")
    times = [record["step_time_s"] for record in read_metrics(metrics) if "step_time_s" in record]
    times = times[skip:] or times
    if not times:
        raise HlatError(f"--calibrate: {metrics} has no logged steps")
    return config, statistics.median(times)
