"""The `[parallel]` config section (torch-free): mesh degrees, pipeline schedule, ZeRO-1, recomputation."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

from hlat.fields import ConfigError
from hlat.models.config import ModelConfig


def world_size_from_env() -> int:
    """Processes in this job: torchrun sets WORLD_SIZE; a plain `hlat train` is one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def compilable(tp: int, recompute: str) -> bool:
    """Whether torch can compile a block at tensor-parallel degree `tp` under recomputation `recompute`: torch 2.13's
    compiled autograd cannot save the tensor-parallel mesh inside a checkpointed block."""
    return tp == 1 or recompute == "none"


def stage_layers(n_layers: int, n_stages: int) -> list[range]:
    """Consecutive blocks per stage, as even as possible; the first and last stages, which also hold the
    embedding and the output projection, get the smaller share when the split is uneven."""
    base, extra = divmod(n_layers, n_stages)
    sizes = [base] * n_stages
    middle_first = list(range(1, n_stages - 1)) + [0, n_stages - 1]
    for i in middle_first[:extra]:
        sizes[i] += 1
    starts = [sum(sizes[:i]) for i in range(n_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


@dataclass
class ParallelConfig:
    dp_replicate: int = 1  # replicated data parallelism (DDP; with dp_shard > 1, HSDP); -1 fills the world size
    dp_shard: int = -1  # FSDP degree; -1 fills what the other degrees leave of the world size (one of the two)
    tp: int = 1  # tensor parallelism (with sequence parallelism in the norm regions when sequence_parallel)
    pp: int = 1  # pipeline stages (x virtual_stages stage modules under interleaved_1f1b)
    cp: int = 1  # context parallelism: sequences split over cp ranks, sharing FSDP's sharding (docs/long-context.md)
    # expert parallelism: each mixture-of-experts layer's experts spread over ep of the dp_shard x cp ranks, which
    # send each other their tokens' choices (docs/moe.md)
    ep: int = 1
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    virtual_stages: int = 2  # stage modules per pipeline rank under interleaved_1f1b
    sequence_parallel: bool = True
    zero1: bool = False  # shard optimizer states (and gradients) over dp_shard, gather parameters once a step
    activation_checkpoint: Literal["none", "selective", "full"] = "none"  # selective recomputes attention
    data_sharding: Literal["global", "files"] = "global"  # see docs/data.md
    compile: bool = False  # torch.compile each block
    compile_backend: str = "inductor"  # torch.compile backend (a device's plugin may register its own)
    compile_cache_dir: str = ""  # "" = the node's local disk (/tmp/hlat-compile-cache), not a shared FS
    # data-parallel replica groups as fault domains (docs/fault-tolerance.md, "Replica groups"): 0 = off; N >= 2:
    # the job is N replica groups, each its own torchrun job of this layout meeting at the hlat service, and a
    # failure in one restarts only it while the others step on; it rejoins by healing from a live group
    replica_groups: int = 0
    replica_group: int = 0  # which replica group this torchrun job is (hlat launch sets it)

    def stages(self) -> int:
        return self.pp * (self.virtual_stages if self.pp_schedule == "interleaved_1f1b" else 1)

    def rank_stages(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank `pp_rank` runs: one, or under interleaved_1f1b one per virtual stage (looped:
        rank r holds stages r, r + pp, r + 2 pp, ...)."""
        return [pp_rank + k * self.pp for k in range(self.stages() // self.pp)]

    def resolved(self, world_size: int) -> ParallelConfig:
        """A copy with dp_shard (or dp_replicate) filled in, checked against the world size."""
        for name in ("tp", "pp", "cp", "ep", "virtual_stages"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name}: must be >= 1, got {getattr(self, name)}")
        if world_size % self.cp:
            raise ConfigError(f"parallel.cp: {self.cp} does not divide the world size {world_size}")
        if self.dp_replicate == -1 and self.dp_shard == -1:
            raise ConfigError("parallel: dp_replicate and dp_shard are both -1; at most one can fill the world size")
        if self.dp_replicate < 1 and self.dp_replicate != -1:
            raise ConfigError(f"parallel.dp_replicate: must be >= 1 or -1, got {self.dp_replicate}")
        dp = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard}
        fill = next((name for name, degree in dp.items() if degree == -1), None)
        if fill:
            fixed = self.tp * self.pp * self.cp * (dp["dp_shard"] if fill == "dp_replicate" else dp["dp_replicate"])
            if world_size % fixed:
                other = "dp_shard" if fill == "dp_replicate" else "dp_replicate"
                raise ConfigError(
                    f"parallel: {other} x tp x pp x cp = {fixed} does not divide the world size {world_size}"
                )
            dp[fill] = world_size // fixed
        total = dp["dp_replicate"] * dp["dp_shard"] * self.tp * self.pp * self.cp
        if dp["dp_shard"] < 1 or total != world_size:
            raise ConfigError(
                f"parallel: dp_replicate {dp['dp_replicate']} x dp_shard {dp['dp_shard']} x tp "
                f"{self.tp} x pp {self.pp} x cp {self.cp} = {total}, but the world size is {world_size}"
            )
        return ParallelConfig(**{**self.__dict__, **dp})

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each takes its own micro-batches (context-parallel peers share theirs)."""
        return self.dp_replicate * self.dp_shard

    @property
    def shards(self) -> int:
        """Ranks FSDP (or ZeRO-1) shards the parameters over: dp_shard x cp, the context-parallel ranks sharing the
        sharding as they share the micro-batches' gradients."""
        return self.dp_shard * self.cp

    @property
    def expert_shards(self) -> int:
        """Ranks FSDP shards each expert over: the dp_shard x cp ranks that hold the same experts."""
        return self.shards // self.ep

    @property
    def fsdp_dim(self) -> str:
        """The name of that sharding's mesh dimension (hlat.parallel.mesh)."""
        return "dp_shard" if self.cp == 1 else "dp_shard_cp"

    def microbatches(self, global_batch: int, micro_batch: int) -> int:
        """Micro-batches each data-parallel rank (each pipeline) runs per optimizer step."""
        if global_batch % (micro_batch * self.dp):
            raise ConfigError(
                f"train.global_batch: {global_batch} is not divisible by micro_batch {micro_batch} x "
                f"data-parallel size {self.dp}"
            )
        return global_batch // (micro_batch * self.dp)

    def validate(self, model: ModelConfig, world_size: int) -> ParallelConfig:
        """Everything about the model and the world size that can be checked before any process group exists;
        returns the resolved config. `check_layout` adds the batch."""
        p = self.resolved(world_size)
        for field, size in (("n_heads", model.n_heads), ("ffn_dim", model.ffn_dim), ("vocab_size", model.vocab_size)):
            if size % p.tp:
                raise ConfigError(f"parallel.tp: {p.tp} does not divide model.{field} {size}")
        if model.kv_heads % p.tp and p.tp % model.kv_heads:  # fewer kv heads than ranks: they are replicated
            raise ConfigError(f"parallel.tp: {p.tp} and model.n_kv_heads {model.kv_heads}: one must divide the other")
        if model.n_layers < p.stages():
            raise ConfigError(f"parallel.pp: {p.stages()} pipeline stages but only {model.n_layers} layers")
        if p.pp > 1 and model.tie_embeddings:
            raise ConfigError(
                "parallel.pp: tied embeddings cannot be split across pipeline stages; set model.tie_embeddings = false"
            )
        check_experts(p, model)
        check_replica_groups(p)
        if p.compile and not p.compile_backend:
            raise ConfigError("parallel.compile_backend: empty; 'inductor' is torch's default")
        if p.zero1 and p.shards == 1:
            raise ConfigError("parallel.zero1: shards optimizer states over dp_shard x cp, which is 1")
        if p.compile and not compilable(p.tp, p.activation_checkpoint):
            raise ConfigError(
                f"parallel.compile: not supported with tp > 1 and activation_checkpoint = "
                f"{p.activation_checkpoint!r} in this torch; turn compile or recomputation off"
            )
        return p


def check_experts(p: ParallelConfig, model: ModelConfig) -> None:
    """Expert parallelism against the model and the data-parallel ranks it spreads the experts over."""
    if p.ep > 1 and not model.moe:
        raise ConfigError(f"parallel.ep: {p.ep} needs a mixture-of-experts model (model.n_experts > 0)")
    if model.moe and model.n_experts % p.ep:
        raise ConfigError(f"parallel.ep: {p.ep} does not divide model.n_experts {model.n_experts}")
    if p.shards % p.ep:
        raise ConfigError(
            f"parallel.ep: {p.ep} does not divide dp_shard x cp = {p.shards} (the expert-parallel ranks are data- "
            "or context-parallel ranks, each routing its own tokens)"
        )
    if p.compile and model.moe:
        raise ConfigError("parallel.compile: not supported for mixture-of-experts models (model.n_experts > 0)")
    local, shards = model.n_experts // p.ep, p.expert_shards
    if p.ep > 1 and local % shards and (model.ffn_dim // p.tp % shards or model.dim % shards):
        raise ConfigError(
            f"parallel.ep: FSDP shards each rank's {local} experts over the {shards} ranks holding them (dp_shard x "
            f"cp / ep), by experts or by rows: neither divides (ffn_dim / tp {model.ffn_dim // p.tp}, dim {model.dim})"
        )


def check_replica_groups(p: ParallelConfig) -> None:
    """Replica groups as fault domains: each group is a whole torchrun job, so its tensor, pipeline, context and expert
    groups are its own; what the cross-replica all-reduce and the shared data stream cannot serve is refused."""
    if p.replica_groups == 0:
        return
    if p.replica_groups < 2 or not 0 <= p.replica_group < p.replica_groups:
        raise ConfigError(
            f"parallel.replica_groups: {p.replica_groups} with replica_group {p.replica_group}: needs at least 2 "
            "groups (0 = off) and 0 <= replica_group < replica_groups"
        )
    if p.data_sharding != "global" or p.pp > 1:
        raise ConfigError(
            "parallel.replica_groups: needs data_sharding = 'global' (the live groups share each step's "
            f"micro-batches) and pp = 1 (got {p.data_sharding!r}, pp {p.pp})"
        )


def every_membership(dp: int, groups: int) -> int:
    """The divisor of a step's micro-batches that lets any number of live replica groups (1 to `groups`) of `dp`
    data-parallel ranks each share them evenly: dp x lcm(1, ..., groups)."""
    return dp * math.lcm(*range(1, groups + 1))


def check_layout(
    parallel: ParallelConfig, model: ModelConfig, world_size: int, global_batch: int, micro_batch: int, seq_len: int
) -> ParallelConfig:
    """The one check of a layout, for the trainer (before any process group starts) and for the planner (for
    every candidate): raises ConfigError naming the field, or returns the resolved config."""
    p = parallel.validate(model, world_size)
    accum = p.microbatches(global_batch, micro_batch)
    if p.replica_groups and (global_batch // micro_batch) % every_membership(p.dp, p.replica_groups):
        raise ConfigError(
            f"parallel.replica_groups: the {global_batch // micro_batch} micro-batches of a step (train.global_batch"
            f" / micro_batch) must divide among any number of live groups of {p.dp} data-parallel ranks: make them "
            f"a multiple of {every_membership(p.dp, p.replica_groups)}"
        )
    if p.cp > 1 and seq_len % (2 * p.cp):
        raise ConfigError(
            f"parallel.cp: train.seq_len {seq_len} is not divisible by 2 x cp = {2 * p.cp} (each "
            "context-parallel rank holds 2 of 2 x cp equal chunks of every sequence)"
        )
    if (p.sequence_parallel or model.moe) and p.tp > 1 and (seq_len // p.cp) % p.tp:
        raise ConfigError(
            f"parallel.{'sequence_parallel' if p.sequence_parallel else 'tp'}: tp {p.tp} does not divide the "
            f"{seq_len // p.cp} tokens of each sequence a rank holds (train.seq_len {seq_len} / cp {p.cp}), which "
            f"{'sequence parallelism' if p.sequence_parallel else 'mixture-of-experts layers'} split over tp"
        )
    if p.pp > 1 and accum < p.pp:
        raise ConfigError(
            f"parallel.pp: {accum} micro-batches per step (global_batch / (micro_batch x dp)) "
            f"cannot fill {p.pp} pipeline stages; use a smaller train.micro_batch"
        )
    if p.pp_schedule == "interleaved_1f1b" and p.pp > 1 and accum % p.pp:
        raise ConfigError(
            f"parallel.pp_schedule: interleaved_1f1b needs the {accum} micro-batches per step "
            f"to be a multiple of pp {p.pp}"
        )
    return p
