"""What the planner reasons about: the workload (model, sequence, batch, precision) and a parallel layout, which
is the trainer's own `ParallelConfig` (resolved) plus the micro-batch of `[train]`."""

from __future__ import annotations

from dataclasses import asdict, astuple, dataclass, fields, replace

from hlat.fields import ConfigError
from hlat.models.config import ModelConfig
from hlat.optim.config import PrecisionConfig
from hlat.optim.modes import MODES
from hlat.parallel.config import ParallelConfig, check_layout
from hlat.planner.costs import block_shape


@dataclass(frozen=True)
class Workload:
    model: ModelConfig
    seq_len: int
    global_batch: int  # sequences per optimizer step
    precision: str = "bf16_mixed"  # a key of hlat.optim.modes.MODES
    compile: bool = False  # the layouts a search proposes compile each block (`parallel.compile`), as the run will
    fp8: str = "none"  # `precision.fp8`: the blocks' linear layers in FP8 with this scaling recipe (a bf16 mode)
    # a mixture of experts under expert parallelism: the choices the busiest rank's experts take, against an even
    # share (1: balanced, as the load-balancing loss drives a router; a run logs its experts' as moe_imbalance)
    expert_load: float = 1.0

    def __post_init__(self) -> None:
        PrecisionConfig(self.precision, self.fp8).validate()  # the config's own rules (FP8 over a bf16 mode)
        if self.expert_load <= 0:
            raise ConfigError(f"expert load: must be positive, got {self.expert_load}")

    def load(self, layout: Layout) -> float:
        """The choices the busiest rank's experts take against an even share: `expert_load` under expert
        parallelism, at most the capacity an expert has (`model.capacity_factor`); 1 where one rank holds every
        expert, or for a dense model."""
        if layout.ep == 1 or not self.model.moe:
            return 1.0
        return min(self.expert_load, self.model.capacity_factor or self.expert_load)

    @property
    def mode(self):
        return MODES[self.precision]

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of activations and of communicated activations and gradients."""
        return 4 if self.precision == "fp32" else 2

    @property
    def stream_bytes(self) -> int:
        """Bytes per element of the residual stream (the parameters' dtype: fp32 under bf16_mixed), which pipeline
        stages send and sequence parallelism gathers."""
        return self.mode.weight_bytes

    @property
    def tp_message_bytes(self) -> float:
        """Bytes per element of a tensor-parallel collective, on average: half of them carry the residual stream
        (the gathered norm outputs, and their gradients), half the matmuls' outputs (and theirs)."""
        return (self.compute_bytes + self.stream_bytes) / 2

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch


PARALLEL_FIELDS = tuple(f.name for f in fields(ParallelConfig))


@dataclass(frozen=True, eq=False)
class Layout:
    """A layout as the trainer runs it: a resolved `ParallelConfig` (no dp_shard = -1) and `[train] micro_batch`.
    The properties read it the way the trainer does (interleaving only under interleaved_1f1b, sequence
    parallelism only with tp > 1, ZeRO-1 sharding optimizer states over dp_shard)."""

    parallel: ParallelConfig
    micro_batch: int = 1

    @classmethod
    def of(cls, micro_batch: int = 1, **parallel) -> Layout:
        """A layout from `[parallel]` fields; unlike the trainer's config, dp_shard defaults to 1 (the planner
        states every degree) and interleaving needs virtual_stages."""
        parallel.setdefault("dp_shard", 1)
        if parallel.get("virtual_stages", 1) > 1:
            parallel.setdefault("pp_schedule", "interleaved_1f1b")
        parallel.setdefault("virtual_stages", 1)
        return cls(ParallelConfig(**parallel), micro_batch)

    def replaced(self, micro_batch: int | None = None, **parallel) -> Layout:
        """A copy with some `[parallel]` fields (or the micro-batch) changed."""
        return Layout(replace(self.parallel, **parallel), micro_batch or self.micro_batch)

    def _key(self) -> tuple:
        return (astuple(self.parallel), self.micro_batch)

    def __eq__(self, other) -> bool:
        return isinstance(other, Layout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def tp(self) -> int:
        return self.parallel.tp

    @property
    def pp(self) -> int:
        return self.parallel.pp

    @property
    def dp_replicate(self) -> int:
        return self.parallel.dp_replicate

    @property
    def dp_shard(self) -> int:
        return self.parallel.dp_shard

    @property
    def cp(self) -> int:
        return self.parallel.cp

    @property
    def ep(self) -> int:
        return self.parallel.ep

    @property
    def shards(self) -> int:
        """Ranks the parameters' shards, and ZeRO-1's, are spread over: dp_shard x cp."""
        return self.parallel.shards

    def held(self, seq_len: int) -> int:
        """The tokens of each sequence one rank holds: its share under context parallelism."""
        return seq_len // self.cp

    @property
    def dp(self) -> int:
        return self.parallel.dp

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def pp_schedule(self) -> str:
        return self.parallel.pp_schedule

    @property
    def virtual_stages(self) -> int:
        """Model chunks per pipeline rank: 1 unless the schedule interleaves."""
        return self.parallel.stages() // self.pp

    @property
    def sequence_parallel(self) -> bool:
        return self.parallel.sequence_parallel and self.tp > 1

    @property
    def zero1(self) -> bool:
        return self.parallel.zero1

    @property
    def activation_checkpoint(self) -> str:
        return self.parallel.activation_checkpoint

    @property
    def param_shard(self) -> int:
        """How many ways the stored parameters and gradients are sharded (FSDP's dp_shard x cp; 1 under ZeRO-1)."""
        return 1 if self.zero1 else self.shards

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches each pipeline (data-parallel replica) runs per optimizer step."""
        return self.parallel.microbatches(global_batch, self.micro_batch)

    @property
    def sharding(self) -> str:
        if self.zero1:
            return "zero1"
        if self.shards > 1:
            return "fsdp" if self.dp_replicate == 1 else "hsdp"
        return "ddp"

    def describe(self) -> str:
        """Compact: 'TP8 PP4 DP64 mb1 1F1B vpp2 SP ZeRO-1 AC:sel' (and CP4 and EP8 after DP with context and
        expert parallelism)."""
        parts = [
            f"TP{self.tp}",
            f"PP{self.pp}",
            f"DP{self.dp}",
            *([f"CP{self.cp}"] if self.cp > 1 else []),
            *([f"EP{self.ep}"] if self.ep > 1 else []),
            f"mb{self.micro_batch}",
        ]
        if self.pp > 1:
            parts.append(
                {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": f"1F1B vpp{self.virtual_stages}"}[
                    self.pp_schedule
                ]
            )
        if self.sequence_parallel:
            parts.append("SP")
        parts.append({"ddp": "DDP", "zero1": "ZeRO-1", "fsdp": "FSDP", "hsdp": f"HSDP{self.shards}"}[self.sharding])
        parts.append({"none": "AC:none", "selective": "AC:sel", "full": "AC:full"}[self.activation_checkpoint])
        return " ".join(parts)

    def block_shape(self, work: Workload) -> str:
        """The key under which preflight records a whole block of `work` run in this layout
        (`hlat.planner.costs.block_shape`)."""
        return block_shape(
            work.model,
            work.seq_len,
            self.micro_batch,
            work.precision,
            self.tp,
            self.sequence_parallel,
            self.activation_checkpoint,
            compiled=self.parallel.compile,
            fp8=work.fp8,
            cp=self.cp,
        )

    def config_sections(self, work: Workload) -> dict:
        """The `[parallel]` and `[train]` config tables the trainer runs as they are: every layout field."""
        parallel = {k: getattr(self.parallel, k) for k in PARALLEL_FIELDS}
        train = {"seq_len": work.seq_len, "global_batch": work.global_batch, "micro_batch": self.micro_batch}
        return {"parallel": parallel, "train": train}

    def run_config(self, work: Workload) -> dict:
        """A complete config `hlat train` runs: the model, the precision mode and this layout."""
        return {
            "model": asdict(work.model),
            "precision": {"mode": work.precision, "fp8": work.fp8},
            **self.config_sections(work),
        }


def layout_problem(work: Workload, layout: Layout, devices: int) -> str | None:
    """Why `layout` cannot run `work` on `devices` devices (the trainer's own check), or None when it can."""
    if layout.dp_shard < 1:
        return "dp_shard must be resolved (>= 1)"
    if layout.micro_batch < 1:
        return "micro-batch must be >= 1"
    try:
        check_layout(layout.parallel, work.model, devices, work.global_batch, layout.micro_batch, work.seq_len)
    except ConfigError as e:
        return str(e)
    return None
