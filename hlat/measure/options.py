"""What `hlat preflight` measures (`Options`); no torch, so the command line can build and check it cheaply."""

from __future__ import annotations

from dataclasses import dataclass, field

from hlat.models.config import ModelConfig
from hlat.optim import OptimConfig
from hlat.optim.config import FP8_RECIPES
from hlat.parallel.config import compilable
from hlat.planner.layout import Layout
from hlat.planner.memory import sharded_units

DATA_PARALLEL = ("fsdp", "zero1", "ddp")  # arrangements blocks can be timed under (`Layout.sharding`'s names)


@dataclass
class Options:
    model: ModelConfig
    seq_len: int
    micro_batch: int
    tps: tuple[int, ...] = (1,)  # tensor-parallel degrees whose matmul shapes are measured
    other_micro_batches: tuple[int, ...] = ()  # the matmul shapes of these micro-batches are measured too
    dtypes: tuple[str, ...] = ("fp32",)
    fp8: tuple[str, ...] = FP8_RECIPES  # recipes whose FP8 linears are timed, where the device has FP8 tensor cores
    sizes: tuple[int, ...] = tuple(2**k for k in range(12, 25, 3))  # bytes per device: 4 KiB to 16 MiB
    repeats: int = 5
    threshold: float = 0.8  # a device or link below this share of the median (or of the profile) fails
    memory_fraction: float = 0.9
    delay_rank: int = -1  # debug: this rank sleeps delay_ms before every collective
    delay_ms: float = 0.0
    perturb_rank: int = -1  # debug: this rank's numerics check sees different inputs
    # the trainer's settings a whole block is timed under (`hlat.measure.blocks`)
    data_parallel: tuple[str, ...] = ()  # of DATA_PARALLEL: timed again under each, where ranks are left over
    precision: str = "fp32"
    sequence_parallel: bool = True
    recompute: str = "none"
    compile: bool = False  # parallel.compile: blocks compiled, as the trainer compiles them (`compiled_blocks`)
    compile_backend: str = "inductor"
    optim: OptimConfig = field(default_factory=OptimConfig)  # the update timed after the blocks (`measure_update`)
    device: str = "auto"  # train.device

    def compiled_blocks(self, tp: int) -> bool:
        """Whether blocks timed at `tp` run compiled: as configured, except where torch cannot compile them
        (`compilable`; the config refuses those for its own tp)."""
        return self.compile and compilable(tp, self.recompute)

    def micro_batches(self) -> list[int]:
        """Every micro-batch whose shapes are measured, smallest first."""
        return sorted({self.micro_batch, *self.other_micro_batches})


def default_sizes(model: ModelConfig) -> tuple[int, ...]:
    """4 KiB to 16 MiB by 8x, and the sizes of the model's own data-parallel messages (fp32, without tensor
    parallelism: one block, and the rest of the model), up to 1 GiB: the trainer reduces and gathers one
    `fully_shard` unit at a time, and the rate at 16 MiB need not hold at a 200 MB embedding."""
    units = {min(int(params) * 4, 2**30) for _, params in sharded_units(model, Layout.of())}
    return tuple(sorted(set(Options.sizes) | {u for u in units if u > 0}))
