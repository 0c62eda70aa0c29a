"""Hardware profiles (`hardware/*.toml`) and the calibration that fits their efficiency factors.

A profile holds public figures (devices, memory, peak FLOP/s, link bandwidths and latencies, prices) and a `[fit]`
table of factors that turn nominal times into predicted ones. The step-time model is piecewise linear in those
factors (see `hlat.planner.timing`), so fitting them to measured step times is a short series of small
non-negative least-squares problems on relative errors, each solved exactly without numpy.
"""

from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

from hlat import HlatError
from hlat.config import ConfigError, load_toml, to_toml, update
from hlat.planner.layout import Layout, Workload
from hlat.resources import HARDWARE_DIR

@dataclass
class Fit:
    """Measured-over-nominal factors. Predicted step time = sum of factor x nominal term (+ the optimizer step)."""

    flops_factor: float = 2.0  # seconds per second of peak-rate FLOPs: 1 / achieved compute efficiency
    layer_overhead_ms: float = 0.0  # fixed cost per layer per micro-batch (kernel launches, small ops)
    intra_factor: float = 1.0  # intra-node collectives and transfers, measured / nominal time
    inter_factor: float = 1.0  # inter-node collectives and transfers, measured / nominal time
    dp_factor: float = 1.0  # data-parallel gradient reduction: exposed (not overlapped) share / link efficiency
    attention_factor: float = 0.0  # materialised attention scores: nominal passes over them (0: folded into flops)
    p2p_ms: float = 0.0  # fixed cost of each pipeline send or receive (a blocking handshake between stages)
    source: str = "defaults, not fitted"


FACTORS = ("flops_factor", "layer_overhead_ms", "intra_factor", "inter_factor", "dp_factor", "attention_factor",
           "p2p_ms")


@dataclass
class Measured:
    """What `hlat preflight` measured on the hardware (empty: nothing; the fitted factors price everything).

    Tables are [size, rate] rows sorted by size: matmuls by FLOPs per call (TFLOP/s achieved), attention by
    sequence length (TFLOP/s of the nominal FLOPs of `hlat.planner.costs.attention_flops`), collectives by bytes
    per device (bus bandwidth in GB/s, as nccl-tests report it; send_recv: bytes over seconds). Memory-bound
    operations are GB/s of the nominal bytes of `hlat.planner.costs`."""

    source: str = ""
    matmul_bf16: list[list[float]] = field(default_factory=list)
    matmul_fp32: list[list[float]] = field(default_factory=list)
    attention_bf16: list[list[float]] = field(default_factory=list)
    attention_fp32: list[list[float]] = field(default_factory=list)
    norm_gbs: float = 0.0
    activation_gbs: float = 0.0
    rotary_gbs: float = 0.0
    residual_gbs: float = 0.0
    loss_gbs: float = 0.0
    optimizer_gbs: float = 0.0
    copy_gbs: float = 0.0  # a copy into a freshly allocated buffer, as fully_shard's gathers and reductions make
    all_reduce: list[list[float]] = field(default_factory=list)
    all_gather: list[list[float]] = field(default_factory=list)
    reduce_scatter: list[list[float]] = field(default_factory=list)
    send_recv: list[list[float]] = field(default_factory=list)
    overlap: float = -1.0  # share of a collective that hides behind concurrent compute (-1: not measured)
    # Whole blocks of the real model, timed forward + backward as the trainer runs them (tensor-parallel
    # collectives, recomputation and precision included), one entry per `hlat.planner.costs.block_shape`;
    # `ends_s`: the rest of a micro-batch on one rank (embedding, final norm, output layer and loss), of which
    # `embedding_s` is the embedding's part (on a pipeline's first stage; the rest is on its last).
    block_shapes: list[str] = field(default_factory=list)
    block_s: list[float] = field(default_factory=list)
    ends_s: list[float] = field(default_factory=list)
    embedding_s: list[float] = field(default_factory=list)

    def block(self, shape: str) -> tuple[float, float, float] | None:
        """Seconds of one block, of the ends of a micro-batch and of its embedding (0 where a profile predates
        that figure), measured at exactly `shape`, or None."""
        if shape not in self.block_shapes:
            return None
        i = self.block_shapes.index(shape)
        return self.block_s[i], self.ends_s[i], self.embedding_s[i] if i < len(self.embedding_s) else 0.0

    def figures(self) -> dict[str, bool]:
        """Which figures were measured, by name."""
        return {"matmul": bool(self.matmul_bf16 or self.matmul_fp32),
                "attention": bool(self.attention_bf16 or self.attention_fp32),
                "whole block": bool(self.block_shapes),
                "data-parallel block": any(" | dp" in shape for shape in self.block_shapes), "memory-bound": self.norm_gbs > 0,
                "optimizer": self.optimizer_gbs > 0,
                "collectives": bool(self.all_reduce), "send/recv": bool(self.send_recv), "overlap": self.overlap >= 0}


@dataclass
class HardwareProfile:
    name: str = ""
    description: str = ""
    devices_per_node: int = 8  # the unit the parallel degrees count (GPU, or Trainium NeuronCore)
    memory_gib: float = 80.0  # per device
    peak_tflops: float = 312.0  # dense bf16, per device
    hbm_gbs: float = 2000.0  # device memory bandwidth, GB/s (the optimizer step is bound by it)
    intra_gbs: float = 300.0  # per device, one direction, GB/s
    intra_latency_us: float = 5.0  # per step of a ring collective
    inter_gbps: float = 400.0  # per node, Gbit/s
    inter_latency_us: float = 20.0
    overhead_gib: float = 2.0  # runtime, communication buffers and fragmentation, per device
    price_on_demand: float = 0.0  # USD per node-hour; 0 = unknown
    price_reserved: float = 0.0
    flash_attention: bool = True  # the attention scores are never stored (fused attention kernels)
    supports_fsdp: bool = True  # whether the search considers FSDP on this hardware's software stack
    # what a layer keeps for backward: hlat's trainer (torch autograd, as tests/test_activation_memory.py counts
    # it), or a Megatron-style stack (Megatron-LM, NeuronX Distributed: Korthikanti et al.'s accounting)
    activations: Literal["hlat", "megatron"] = "hlat"
    fit: Fit = field(default_factory=Fit)
    measured: Measured = field(default_factory=Measured)

    def sources(self) -> str:
        """Which figures of the step-time model are measured and which fall back to the fitted factors."""
        figures = self.measured.figures()
        measured = [k for k, v in figures.items() if v]
        if not measured:
            return f"all figures fitted ({self.fit.source})"
        fitted = [k for k, v in figures.items() if not v]
        return (f"measured: {', '.join(measured)} ({self.measured.source})"
                + (f"; fitted: {', '.join(fitted)} ({self.fit.source})" if fitted else ""))

    def validate(self) -> "HardwareProfile":
        for name in ("devices_per_node", "memory_gib", "peak_tflops", "hbm_gbs", "intra_gbs", "inter_gbps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"hardware {self.name!r}: {name} must be positive, got {getattr(self, name)}")
        for name in ("intra_latency_us", "inter_latency_us", "overhead_gib", "price_on_demand", "price_reserved",
                     *FACTORS):
            value = getattr(self.fit if name in FACTORS else self, name)
            if value < 0:
                raise ConfigError(f"hardware {self.name!r}: {name} must be >= 0, got {value}")
        return self

    def price(self, kind: str) -> float:
        return {"on_demand": self.price_on_demand, "reserved": self.price_reserved}[kind]

    def to_toml(self) -> str:
        return to_toml(asdict(self))


def profile_names() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.toml"))


def load_profile(name_or_path: str) -> HardwareProfile:
    """A profile by name (a file in hardware/) or by path to a TOML file of the same shape."""
    path = Path(name_or_path)
    if path.suffix != ".toml":  # a name, like "trn1.32xlarge"
        path = HARDWARE_DIR / f"{name_or_path}.toml"
        if not path.is_file():
            raise HlatError(f"--hardware: unknown profile {name_or_path!r} (known: {', '.join(profile_names())}; "
                            "or give a TOML file)")
    data = load_toml(path)
    hw = update(HardwareProfile(name=path.stem), data, f"{path}: ")
    return hw.validate()


# --- calibration -----------------------------------------------------------------------------------------------


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


def fit_factors(samples: list[Sample], free: tuple[str, ...], base: Fit, source: str,
                weights: list[float] | None = None, rounds: int = 30) -> Fit:
    """Fit the `free` factors of `base` to the samples, minimising the (weighted) squared relative error of the
    step time; the other factors keep their values from `base`. The model is linear in the factors wherever each
    layer stays host- or device-bound, so each round solves the linear problem around the current factors and
    the next round re-linearises, until the factors no longer move."""
    from hlat.planner.timing import step_time  # timing imports this module for Fit

    if not samples:
        raise HlatError("calibration: no measurements to fit")
    unknown = set(free) - set(FACTORS)
    if unknown:
        raise HlatError(f"calibration: unknown factors {sorted(unknown)} (known: {', '.join(FACTORS)})")
    weights = weights or [1.0] * len(samples)

    def objective(x: dict[str, float]) -> float:
        current = replace(base, **x)
        return sum(w * (step_time(s.workload, s.layout, s.hardware, current).total / s.step_s - 1) ** 2
                   for s, w in zip(samples, weights))

    def descend(x: dict[str, float]) -> tuple[float, dict[str, float]]:
        best = objective(x)
        for _ in range(rounds):
            current = replace(base, **x)
            rows, targets = [], []
            for s, w in zip(samples, weights):
                t0 = step_time(s.workload, s.layout, s.hardware, current).total
                # Slopes by finite differences: exact within a linear piece.
                slopes = [(step_time(s.workload, s.layout, s.hardware, replace(current, **{k: x[k] + 1e-3})).total
                           - t0) / 1e-3 for k in free]
                scale = w ** 0.5 / s.step_s
                rows.append([c * scale for c in slopes])
                # t = t0 + slopes . (x' - x), solved for the excess x' - floor >= 0.
                rest = t0 - sum(c * (x[k] - FLOORS.get(k, 0.0)) for c, k in zip(slopes, free))
                targets.append((s.step_s - rest) * scale)
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
    _, x = min((descend({k: FLOORS.get(k, 0.0) + start for k in free}) for start in (1.0, 10.0)),
               key=lambda result: result[0])
    return replace(base, source=source, **{k: round(v, 4) for k, v in x.items()})


def read_run(run_dir: str | Path, skip: int = 1) -> tuple[dict, float]:
    """The resolved config and the median step time of an hlat run directory (config.toml + metrics.jsonl).
    The first `skip` logged intervals are dropped: they include compilation and warm-up."""
    run = Path(run_dir)
    metrics = run / "metrics.jsonl"
    if not (metrics.is_file() and (run / "config.toml").is_file()):
        raise HlatError(f"--calibrate: {run} is not an hlat run directory (needs config.toml and metrics.jsonl)")
    config = load_toml(run / "config.toml")
    times = [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines() if line.strip()]
    times = times[skip:] or times
    if not times:
        raise HlatError(f"--calibrate: {metrics} has no logged steps")
    return config, statistics.median(times)
