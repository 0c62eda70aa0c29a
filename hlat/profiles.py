"""Hardware profiles (`hardware/*.toml`): public figures (devices, memory, peak FLOP/s, link bandwidths and
latencies, prices with their date and source), what `hlat preflight` measured (`Measured`, or derived from
another device's measurement by stated spec ratios), collective bandwidths cited from published nccl-tests runs
(`Links`), the best MFU hlat has measured on the device (`BestMFU`), and a `[fit]` table of factors that turn
nominal times into predicted ones where nothing was measured or cited (`hlat.planner.calibration` fits them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from hlat import HlatError
from hlat.fields import ConfigError, load_toml, to_toml, update
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


FACTORS = (
    "flops_factor",
    "layer_overhead_ms",
    "intra_factor",
    "inter_factor",
    "dp_factor",
    "attention_factor",
    "p2p_ms",
)


@dataclass
class Measured:
    """What `hlat preflight` measured on the hardware (empty: nothing; the fitted factors price everything).

    Tables are [size, rate] rows sorted by size: matmuls by FLOPs per call (TFLOP/s achieved), attention by
    sequence length (TFLOP/s of the nominal FLOPs of `hlat.planner.costs.attention_flops`), collectives by bytes
    per device (bus bandwidth in GB/s, as nccl-tests report it; send_recv: bytes over seconds). Memory-bound
    operations are GB/s of the nominal bytes of `hlat.planner.costs`. FP8 (`matmul_fp8_<recipe>`, one table per
    `precision.fp8` scaling recipe): a torchao `Float8Linear` at each shape of `hlat.planner.costs.block_linears`,
    forward + backward with its casts and scaling, as [forward FLOPs per call, TFLOP/s of the 3 x forward FLOPs
    run] (one row per FLOP count, over every linear layer of it); only a device with FP8 tensor cores has them."""

    source: str = ""
    matmul_bf16: list[list[float]] = field(default_factory=list)
    matmul_fp32: list[list[float]] = field(default_factory=list)
    matmul_fp8_tensorwise: list[list[float]] = field(default_factory=list)
    matmul_fp8_rowwise: list[list[float]] = field(default_factory=list)
    attention_bf16: list[list[float]] = field(default_factory=list)
    attention_fp32: list[list[float]] = field(default_factory=list)
    norm_gbs: float = 0.0
    activation_gbs: float = 0.0
    rotary_gbs: float = 0.0
    residual_gbs: float = 0.0
    loss_gbs: float = 0.0
    optimizer_gbs: float = 0.0  # torch's AdamW (fp32, bf16_mixed)
    bf16_optimizer_gbs: float = 0.0  # BF16AdamW (the pure-bf16 modes: another kernel); 0: priced as optimizer_gbs
    copy_gbs: float = 0.0  # a copy into a freshly allocated buffer, as fully_shard's gathers and reductions make
    all_reduce: list[list[float]] = field(default_factory=list)
    all_gather: list[list[float]] = field(default_factory=list)
    reduce_scatter: list[list[float]] = field(default_factory=list)
    send_recv: list[list[float]] = field(default_factory=list)
    # the nominal bytes of the update preflight timed (0: unknown): a larger update pays the measured time for
    # these and streams the rest at HBM bandwidth (a small update is bound by its launches, a large one by HBM)
    optimizer_measured_bytes: float = 0.0
    overlap: float = -1.0  # share of a collective that hides behind concurrent compute (-1: not measured)
    # Whole blocks of the real model, timed forward + backward as the trainer runs them (tensor-parallel
    # collectives, recomputation and precision included), one entry per `hlat.planner.costs.block_shape`;
    # `ends_s`: the rest of a micro-batch on one rank (embedding, final norm, output layer and loss), of which
    # `embedding_s` is the embedding's part (on a pipeline's first stage; the rest is on its last).
    block_shapes: list[str] = field(default_factory=list)
    block_s: list[float] = field(default_factory=list)
    ends_s: list[float] = field(default_factory=list)
    embedding_s: list[float] = field(default_factory=list)
    # not measured on this device but derived from another's measurement: how (e.g. "H100 preflight, memory-bound
    # rates x 4.8/3.35 HBM"); "" for a measurement
    derived_from: str = ""

    def block(self, shape: str) -> tuple[float, float, float] | None:
        """Seconds of one block, of the ends of a micro-batch and of its embedding (0 where a profile predates
        that figure), measured at exactly `shape`, or None."""
        if shape not in self.block_shapes:
            return None
        i = self.block_shapes.index(shape)
        return self.block_s[i], self.ends_s[i], self.embedding_s[i] if i < len(self.embedding_s) else 0.0

    def fp8_matmul(self, recipe: str) -> list[list[float]]:
        """The FP8 table of a `precision.fp8` recipe ([] where none was measured)."""
        return getattr(self, f"matmul_fp8_{recipe}")

    def figures(self) -> dict[str, bool]:
        """Which figures were measured, by name."""
        return {
            "matmul": bool(self.matmul_bf16 or self.matmul_fp32),
            "fp8 matmul": bool(self.matmul_fp8_tensorwise or self.matmul_fp8_rowwise),
            "attention": bool(self.attention_bf16 or self.attention_fp32),
            "whole block": bool(self.block_shapes),
            "data-parallel block": any(" | dp" in shape for shape in self.block_shapes),
            "memory-bound": self.norm_gbs > 0,
            "optimizer": self.optimizer_gbs > 0 or self.bf16_optimizer_gbs > 0,
            "collectives": bool(self.all_reduce),
            "send/recv": bool(self.send_recv),
            "overlap": self.overlap >= 0,
        }

    def mismatch(self, precision: str) -> str:
        """One line on what a plan in `precision` cannot take from these measurements ('' when nothing is
        missing, or nothing was measured)."""
        if not self.source:
            return ""
        compute = "fp32" if precision == "fp32" else "bf16"
        if not getattr(self, f"matmul_{compute}"):
            return f"the profile measured no {compute} operations: {precision} is priced from its fitted factors"
        if self.block_shapes and not any(f" {precision}" in shape for shape in self.block_shapes):
            return (
                f"the profile timed no whole block in {precision}: its layers are composed from the measured operations"
            )
        return ""


@dataclass
class Links:
    """Bus bandwidth (GB/s, as nccl-tests reports it) against message size (bytes, nccl-tests' `size`) per
    collective, cited from published runs on the instance until a multi-node preflight measures them: within a
    node (NVLink/NVSwitch), [bytes, busbw] rows, and across nodes (EFA/InfiniBand) with every device of each node
    in the collective, [nodes, bytes, busbw] rows. A reduce-scatter without its own rows takes the all-gather's
    (the same ring run backwards), and either without rows the all-reduce's (a ring all-reduce is a
    reduce-scatter then an all-gather, each at the same bus bandwidth)."""

    source: str = ""
    intra_all_reduce: list[list[float]] = field(default_factory=list)
    intra_all_gather: list[list[float]] = field(default_factory=list)
    intra_reduce_scatter: list[list[float]] = field(default_factory=list)
    inter_all_reduce: list[list[float]] = field(default_factory=list)
    inter_all_gather: list[list[float]] = field(default_factory=list)
    inter_reduce_scatter: list[list[float]] = field(default_factory=list)
    inter_latency_us: float = 0.0  # the least time of a collective across nodes (its smallest messages')

    def table(self, op: str, across: bool) -> list[list[float]]:
        where = "inter" if across else "intra"
        mirror = getattr(self, f"{where}_all_gather") if op == "reduce_scatter" else []
        return getattr(self, f"{where}_{op}") or mirror or getattr(self, f"{where}_all_reduce")


@dataclass
class BestMFU:
    """The best MFU hlat has measured on this device, per compute precision (bf16: every bf16 mode, which run
    the same bf16 matmuls and differ only in the optimizer; fp32; fp8: a bf16 mode with FP8 block linears,
    `precision.fp8`, its FLOPs counted against the bf16 peak like every MFU), with the results file it comes from.
    A plan predicted above it is marked: no hlat run has reached it. 0: none measured (no cap)."""

    bf16: float = 0.0
    fp32: float = 0.0
    fp8: float = 0.0
    source: str = ""

    def of(self, precision: str, fp8: str = "none") -> float:
        return self.fp8 if fp8 != "none" else self.fp32 if precision == "fp32" else self.bf16


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
    price_date: str = ""  # when the prices were read (YYYY-MM)
    price_source: str = ""  # where they were read, and what "reserved" means for this instance
    flash_attention: bool = True  # the attention scores are never stored (fused attention kernels)
    supports_fsdp: bool = True  # whether the search considers FSDP on this hardware's software stack
    # what a layer keeps for backward: hlat's trainer (torch autograd, as tests/test_activation_memory.py counts
    # it), or a Megatron-style stack (Megatron-LM, NeuronX Distributed: Korthikanti et al.'s accounting)
    activations: Literal["hlat", "megatron"] = "hlat"
    # what a job asks its scheduler for on each node (`hlat launch`)
    accelerator: Literal["gpu", "neuron", "cpu"] = "gpu"
    scheduler_devices: int = 0  # devices a node exposes to its scheduler (Neuron: chips); 0 = devices_per_node
    fabric: Literal["", "efa"] = ""  # an inter-node fabric that needs settings ("" = plain TCP/IP)
    fabric_devices: int = 0  # its devices per node (EFA: the interfaces, vpc.amazonaws.com/efa)
    vcpus: int = 0  # the node's CPUs and host memory (a Kubernetes job requests 90% of them); 0 = unknown
    host_memory_gib: int = 0
    unsupported: str = ""  # why hlat cannot train on this hardware ("" = it can): `hlat launch` refuses it
    launch_instead: str = ""  # the profile `hlat launch` proposes instead of an unsupported one
    fit: Fit = field(default_factory=Fit)
    measured: Measured = field(default_factory=Measured)
    links: Links = field(default_factory=Links)
    best_mfu: BestMFU = field(default_factory=BestMFU)

    def sources(self) -> str:
        """Which figures of the step-time model are measured (or derived from a measurement), which are cited
        from published runs, and which fall back to the fitted factors (a layer without a measured whole block
        is composed from the measured operations, so blocks are not listed as fitted; FP8 is never fitted: a plan
        that needs it unmeasured is refused)."""
        figures = self.measured.figures()
        cited = self.links.source and not figures["collectives"]
        measured = [k for k, v in figures.items() if v]
        fitted = [
            k
            for k, v in figures.items()
            if not v and "block" not in k and k != "fp8 matmul" and not (cited and k in ("collectives", "overlap"))
        ]
        if not measured and not cited:
            return f"all figures fitted ({self.fit.source})"
        kind = f"derived ({self.measured.derived_from})" if self.measured.derived_from else "measured"
        parts = [f"{kind}: {', '.join(measured)} ({self.measured.source})"] if measured else []
        if cited:
            parts.append(f"cited: collectives ({self.links.source}), overlapped as the trainer overlaps them")
        return "; ".join(parts + ([f"fitted: {', '.join(fitted)} ({self.fit.source})"] if fitted else []))

    def validate(self) -> HardwareProfile:
        for name in ("devices_per_node", "memory_gib", "peak_tflops", "hbm_gbs", "intra_gbs", "inter_gbps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"hardware {self.name!r}: {name} must be positive, got {getattr(self, name)}")
        for name in (
            "intra_latency_us",
            "inter_latency_us",
            "overhead_gib",
            "price_on_demand",
            "price_reserved",
            "scheduler_devices",
            "fabric_devices",
            "vcpus",
            "host_memory_gib",
            *FACTORS,
        ):
            value = getattr(self.fit if name in FACTORS else self, name)
            if value < 0:
                raise ConfigError(f"hardware {self.name!r}: {name} must be >= 0, got {value}")
        return self

    def price(self, kind: str) -> float:
        return {"on_demand": self.price_on_demand, "reserved": self.price_reserved}[kind]

    def price_note(self) -> str:
        """Where the prices come from, and when: '' for a profile that states none."""
        return ", ".join(x for x in (self.price_source, self.price_date) if x)

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
            raise HlatError(
                f"--hardware: unknown profile {name_or_path!r} (known: {', '.join(profile_names())}; "
                "or give a TOML file)"
            )
    data = load_toml(path)
    hw = update(HardwareProfile(name=path.stem), data, f"{path}: ")
    return hw.validate()
