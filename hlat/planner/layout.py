"""What the planner reasons about: the workload (model, sequence, batch, precision) and a parallel layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hlat.models.config import ModelConfig
from hlat.optim.modes import MODES

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
Recompute = Literal["none", "selective", "full"]


@dataclass(frozen=True)
class Workload:
    model: ModelConfig
    seq_len: int
    global_batch: int  # sequences per optimizer step
    precision: str = "bf16_mixed"  # a key of hlat.optim.modes.MODES

    @property
    def mode(self):
        return MODES[self.precision]

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of activations and of gathered or communicated weights."""
        return 4 if self.precision == "fp32" else 2

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch


@dataclass(frozen=True)
class Layout:
    """A parallel layout, named as in the trainer's `[parallel]` config (plus `[train] micro_batch`)."""

    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1  # > 1: parameters, gradients and optimizer states sharded (FSDP; HSDP with dp_replicate)
    micro_batch: int = 1
    pp_schedule: Schedule = "1f1b"
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved_1f1b only)
    sequence_parallel: bool = False
    zero1: bool = False  # optimizer states sharded across data-parallel ranks, parameters replicated
    activation_checkpoint: Recompute = "selective"

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches each pipeline (data-parallel replica) runs per optimizer step."""
        return global_batch // (self.dp * self.micro_batch)

    @property
    def sharding(self) -> str:
        if self.dp_shard > 1:
            return "fsdp" if self.dp_replicate == 1 else "hsdp"
        return "zero1" if self.zero1 else "ddp"

    def describe(self) -> str:
        """Compact: 'TP8 PP4 DP64 mb1 1F1B vpp2 SP ZeRO-1 AC:sel'."""
        parts = [f"TP{self.tp}", f"PP{self.pp}", f"DP{self.dp}", f"mb{self.micro_batch}"]
        if self.pp > 1:
            parts.append({"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": f"1F1B vpp{self.virtual_stages}"}[
                self.pp_schedule])
        if self.sequence_parallel:
            parts.append("SP")
        parts.append({"ddp": "DDP", "zero1": "ZeRO-1", "fsdp": "FSDP", "hsdp": f"HSDP{self.dp_shard}"}[self.sharding])
        parts.append({"none": "AC:none", "selective": "AC:sel", "full": "AC:full"}[self.activation_checkpoint])
        return " ".join(parts)

    def config_sections(self, work: Workload) -> dict:
        """The `[parallel]` and `[train]` config tables the trainer runs as is (the trainer derives the pipeline
        micro-batch count, global_batch / (micro_batch x dp), from them)."""
        # the trainer's ZeRO-1 shards optimizer states over dp_shard: all data-parallel ranks go there
        dp_replicate, dp_shard = (1, self.dp_replicate * self.dp_shard) if self.zero1 else (self.dp_replicate,
                                                                                              self.dp_shard)
        parallel = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": self.tp, "pp": self.pp,
                    "pp_schedule": self.pp_schedule, "sequence_parallel": self.sequence_parallel, "zero1": self.zero1,
                    "activation_checkpoint": self.activation_checkpoint}
        if self.pp_schedule == "interleaved_1f1b":
            parallel["virtual_stages"] = self.virtual_stages
        train = {"seq_len": work.seq_len, "global_batch": work.global_batch, "micro_batch": self.micro_batch}
        return {"parallel": parallel, "train": train}


def layout_problem(work: Workload, layout: Layout, devices: int) -> str | None:
    """Why `layout` cannot run `work` on `devices` devices, or None when it can."""
    m, t = work.model, layout.tp
    if min(t, layout.pp, layout.dp_replicate, layout.dp_shard, layout.micro_batch, layout.virtual_stages) < 1:
        return "degrees and micro-batch must be >= 1"
    if layout.devices != devices:
        return f"tp x pp x dp = {layout.devices}, not the {devices} devices"
    if m.n_heads % t or (m.kv_heads % t and t % m.kv_heads):
        return f"tp {t} does not divide {m.n_heads} heads / {m.kv_heads} kv heads"
    if m.ffn_dim % t or m.vocab_size % t:
        return f"tp {t} does not divide ffn {m.ffn_dim} or vocab {m.vocab_size}"
    if layout.sequence_parallel and (t == 1 or work.seq_len % t):
        return "sequence parallelism needs tp > 1 dividing the sequence length"
    chunks = layout.pp * layout.virtual_stages
    if m.n_layers % chunks:
        return f"{m.n_layers} layers do not split into {chunks} pipeline chunks"
    if work.global_batch % (layout.dp * layout.micro_batch):
        return f"global batch {work.global_batch} is not divisible by dp {layout.dp} x micro-batch {layout.micro_batch}"
    if layout.zero1 and layout.dp_shard > 1:
        return "zero1 and dp_shard > 1 both shard the optimizer: choose one"
    if (layout.pp_schedule == "interleaved_1f1b") != (layout.virtual_stages > 1):
        return "interleaved_1f1b needs virtual_stages > 1, and only it"
    if layout.virtual_stages > 1 and layout.microbatches(work.global_batch) % layout.pp:
        return "interleaved_1f1b needs the micro-batch count to be a multiple of pp"
    return None
