"""The planner's figures for one rank of a layout, for `hlat rehearse` to set beside what it measures (the rest of
the planner prices the busiest device only), and a rehearsal's measurements taken into a plan (`hlat plan
--rehearsal`) in place of the composed ones.

Per rank, the memory is split as a rehearsal counts it: the parameters, gradients and optimizer states as stored
(FSDP and ZeRO-1 both keep a shard of each over dp_shard x cp: the trainer runs ZeRO-1 as `fully_shard` gathering once
a step), what data parallelism gathers for the step (`gathered`: whole parameters and their accumulating
gradients), and what a step keeps for backward at its fullest."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from hlat import HlatError
from hlat.models.config import ModelConfig
from hlat.parallel.config import stage_layers
from hlat.planner.comms import gathered_kv_elements, message_bytes
from hlat.planner.layout import Layout, Workload
from hlat.planner.memory import (
    GIB,
    Memory,
    blocks_activation_bytes,
    cast_bytes,
    head_bytes,
    layer_params_per_device,
    mask_bytes,
    memory,
    norm_bytes,
    rebuilt_bytes,
)
from hlat.planner.timing import micro_batch
from hlat.profiles import HardwareProfile


@dataclass(frozen=True)
class RankPlan:
    """One rank's predicted bytes (per device) and compute seconds per step."""

    params: float
    grads: float
    optimizer: float
    gathered: float
    activations: float
    casts: float  # autocast's bf16 copies of the parameters (bf16_mixed)
    rebuilt: float  # the block full recomputation rebuilds in backward, beside the activations
    compute_s: float  # forward and backward of the step's micro-batches on this rank, communication excluded
    layers: int  # blocks this rank holds


def rank_layers(model: ModelConfig, layout: Layout, pp_rank: int) -> dict[int, int]:
    """{stage id: blocks} of the stages pipeline rank `pp_rank` runs."""
    ranges = stage_layers(model.n_layers, layout.parallel.stages())
    return {sid: len(ranges[sid]) for sid in layout.parallel.rank_stages(pp_rank)}


def rank_params(model: ModelConfig, layout: Layout, pp_rank: int) -> float:
    """Parameters on one device of pipeline rank `pp_rank`: its blocks, the embedding on the first stage, the
    final norm and output projection on the last (tied with the embedding when there is one stage)."""
    stages = rank_layers(model, layout, pp_rank)
    n_stages = layout.parallel.stages()
    params = sum(stages.values()) * layer_params_per_device(model, layout.tp)
    final_norm = model.num_params(embedding=False) - model.n_layers * model.layer_params()
    if 0 in stages and n_stages - 1 in stages:
        return params + model.embedding_params() / layout.tp + final_norm
    embedding = model.vocab_size * model.dim / layout.tp
    return params + (embedding if 0 in stages else 0) + (embedding + final_norm if n_stages - 1 in stages else 0)


def rank_in_flight(layout: Layout, microbatches: int, pp_rank: int) -> float:
    """Micro-batches whose activations pipeline rank `pp_rank` holds at once, in units of its whole share of the
    layers, in the order torch's schedules run them: GPipe all; 1F1B pp - rank; interleaved 1F1B its warm-up's
    stage chunks and one more."""
    p, v = layout.pp, layout.virtual_stages
    if p == 1:
        return 1.0
    if layout.pp_schedule == "gpipe":
        return float(microbatches)
    if layout.pp_schedule == "interleaved_1f1b":
        per_round = microbatches // max(1, microbatches // p)
        return min(microbatches * v, (v - 1) * per_round + 2 * (p - 1 - pp_rank) + 1) / v
    return float(min(microbatches, p - pp_rank))


def rank_activations(work: Workload, layout: Layout, hw: HardwareProfile, pp_rank: int, microbatches: int) -> float:
    """Bytes pipeline rank `pp_rank` keeps for backward as a backward pass begins, at its fullest
    (`hlat.planner.memory.memory`'s accounting for this rank's layers and micro-batches in flight; the head on
    the last stage only), without autocast's casts of the parameters (`RankPlan.casts`) or the block full
    recomputation rebuilds later in backward (`RankPlan.rebuilt`)."""
    stages = rank_layers(work.model, layout, pp_rank)
    in_flight = rank_in_flight(layout, microbatches, pp_rank)
    kept = blocks_activation_bytes(work, layout, hw, sum(stages.values()) * in_flight)
    kept += mask_bytes(work, layout, hw) * in_flight
    if layout.parallel.stages() - 1 in stages:
        kept += head_bytes(work, layout, microbatches, hw.activations, norm_bytes(work, hw))
    return kept


def rank_gathered(work: Workload, layout: Layout, params: float, microbatches: int) -> float:
    """Bytes data parallelism holds whole for the step: under a pipeline or ZeRO-1 every parameter stays gathered
    from the first forward to the last backward, its gradient accumulating whole after the first micro-batch;
    FSDP without a pipeline gathers block by block (its peak is `memory`'s buffers; at a backward pass's start
    only the root unit, the rest of the stage, is whole)."""
    mode = work.mode
    if layout.shards * layout.dp_replicate == 1:
        return 0.0
    if layout.pp > 1 or layout.zero1:
        return params * (mode.weight_bytes + (mode.grad_bytes if microbatches > 1 else 0))
    blocks = math.ceil(work.model.n_layers / layout.pp) * layer_params_per_device(work.model, layout.tp)
    return max(0.0, params - blocks) * mode.weight_bytes


def rank_plan(
    work: Workload, layout: Layout, hw: HardwareProfile, pp_rank: int, microbatches: int | None = None
) -> RankPlan:
    """The planner's figures for pipeline rank `pp_rank` running `microbatches` micro-batches a step (default:
    the step's own)."""
    m = microbatches or layout.microbatches(work.global_batch)
    mode, shard = work.mode, layout.shards
    params, stages = rank_params(work.model, layout, pp_rank), rank_layers(work.model, layout, pp_rank)
    layers, last = sum(stages.values()), layout.parallel.stages() - 1 in stages
    return RankPlan(
        params=params * mode.weight_bytes / shard,
        grads=params * mode.grad_bytes / shard,
        optimizer=params * mode.optimizer_bytes / shard,
        gathered=rank_gathered(work, layout, params, m),
        activations=rank_activations(work, layout, hw, pp_rank, m),
        casts=cast_bytes(work, layout, layers, last) if hw.activations == "hlat" else 0.0,
        rebuilt=rebuilt_bytes(work, layout, hw),
        compute_s=m * rank_compute(work, layout, hw, pp_rank),
        layers=layers,
    )


def rank_compute(work: Workload, layout: Layout, hw: HardwareProfile, pp_rank: int) -> float:
    """Seconds of one micro-batch's forward and backward on pipeline rank `pp_rank`: `micro_batch`'s layer, output
    layer and embedding, summed over the rank's own stages."""
    mb = micro_batch(work, layout, hw, hw.fit)
    layer = (mb.compute - mb.output) / math.ceil(work.model.n_layers / layout.pp)
    stages = rank_layers(work.model, layout, pp_rank)
    last = layout.parallel.stages() - 1
    return sum(stages.values()) * layer + (mb.output if last in stages else 0) + (mb.embedding if 0 in stages else 0)


def rank_traffic(
    work: Workload, layout: Layout, hw: HardwareProfile, pp_rank: int, microbatches: int
) -> dict[tuple[str, str], float]:
    """The collectives `step_time` prices for pipeline rank `pp_rank` over `microbatches`, as bytes per step by
    (kind, mesh dimension), each the whole buffer (a gather's output, a reduction's input): per layer and
    micro-batch 4 (6 with full recomputation) all-reduces of the activation over tp, or as many all-gathers and
    reduce-scatters under sequence parallelism; per layer and micro-batch the keys and values gathered over cp
    (twice with full recomputation) and their gradients reduce-scattered; per micro-batch 2 x virtual stages
    sends and receives of its tp shard of the residual stream over pp (each element `message_bytes`); and data
    parallelism's (`data_parallel_traffic`)."""
    model, m, traffic = work.model, microbatches, {}
    layers = sum(rank_layers(model, layout, pp_rank).values())
    elements = layout.held(work.seq_len) * layout.micro_batch * model.dim
    tp_bytes, pp_bytes = message_bytes(work, hw)
    full = layout.activation_checkpoint == "full"
    if layout.tp > 1:
        per_layer = (6 if full else 4) * elements * tp_bytes
        for kind in ("all_gather", "reduce_scatter") if layout.sequence_parallel else ("all_reduce",):
            traffic[kind, "tp"] = m * layers * per_layer
    if layout.cp > 1:
        kv = m * layers * gathered_kv_elements(work, layout) * work.compute_bytes
        traffic["all_gather", "cp"], traffic["reduce_scatter", "cp"] = (2 if full else 1) * kv, kv
    if layout.pp > 1:
        sent = 2 * layout.virtual_stages * m * elements * pp_bytes / layout.tp
        traffic["send", "pp"] = traffic["recv", "pp"] = sent
    if layout.ep > 1:
        traffic["all_to_all", "ep"] = m * layers * expert_exchange_bytes(work, layout)
    return traffic | data_parallel_traffic(work, layout, rank_params(model, layout, pp_rank), layers, m)


def expert_exchange_bytes(work: Workload, layout: Layout) -> float:
    """The bytes a rank's all-to-alls send for one layer and micro-batch under expert parallelism (each the whole
    input buffer, as `rank_traffic` counts): its tokens' choices to their experts (experts_per_token x dim per token,
    compute dtype) and its experts' outputs back (`load` x that), each again reversed in backward and again in the
    forward's recomputation under full recomputation; and the counts per expert each rank sends (int64)."""
    model = work.model
    choices = layout.held(work.seq_len) * layout.micro_batch * model.experts_per_token * model.dim
    forward = choices * work.compute_bytes * (1 + work.load(layout)) + 8 * model.n_experts
    return forward * (3 if layout.activation_checkpoint == "full" else 2) - 8 * model.n_experts


def data_parallel_traffic(
    work: Workload, layout: Layout, params: float, layers: int, m: int
) -> dict[tuple[str, str], float]:
    """Data parallelism's bytes per step as `hlat.planner.comms.data_parallel_time` prices them: FSDP gathers
    each block twice and the rest once, and reduce-scatters everything, every micro-batch; ZeRO-1 and FSDP under
    a pipeline once a step; replicas all-reduce the gradients (HSDP: the shards') once a step."""
    mode, shard, dim = work.mode, layout.shards, layout.parallel.fsdp_dim
    # under expert parallelism each block's experts (n_experts / ep of them per rank) are a unit of their own, over
    # the ep_shard ranks that hold the same ones
    experts = layers * (work.model.n_experts // layout.ep) * work.model.expert_params() / layout.tp
    experts *= layout.ep > 1
    blocks = layers * layer_params_per_device(work.model, layout.tp, layout.ep) - experts
    traffic: dict[tuple[str, str], float] = {}
    # (dimension, its units' parameters, of which in blocks)
    for unit_dim, unit, block in ((dim, params - experts * layout.ep, blocks), ("ep_shard", experts, experts)):
        if not unit:
            continue
        if layout.param_shard > 1 and layout.pp == 1:  # the blocks gathered twice, the rest once, every micro-batch
            traffic["all_gather", unit_dim] = m * (unit + block) * mode.weight_bytes
            traffic["reduce_scatter", unit_dim] = m * unit * mode.grad_bytes
        elif shard > 1:
            traffic["all_gather", unit_dim] = unit * mode.weight_bytes
            traffic["reduce_scatter", unit_dim] = unit * mode.grad_bytes
    if layout.dp_replicate > 1:
        traffic["all_reduce", "dp_replicate"] = params * mode.grad_bytes / shard
    return traffic


def own_trainer_memory(plan) -> Memory | None:
    """`plan`'s memory as hlat's own trainer keeps it, where its profile prices another stack's activations
    (NeuronX Distributed's on trn1, which recompute or shard what torch's tensor parallelism keeps whole); None
    where the profile's figures are hlat's own."""
    return (
        None if plan.hw.activations == "hlat" else memory(plan.work, plan.layout, replace(plan.hw, activations="hlat"))
    )


def own_trainer_note(plan) -> str | None:
    """Where `plan` fits as its profile's stack keeps memory but hlat's own trainer would not: say so."""
    own = own_trainer_memory(plan)
    if own is None or own.fits or not plan.memory.fits:
        return None
    return (
        f"memory as {plan.hw.name}'s stack keeps it ({plan.hw.activations}); hlat's own trainer {own.shortfall()}"
        " (docs/rehearsal.md)"
    )


def load_rehearsal(path: str) -> dict:
    """A rehearsal's JSON (`hlat rehearse --json`)."""
    try:
        data = json.loads(Path(path).read_text())
        data["ranks"], data["parallel"], data["model_config"]  # noqa: B018 - the keys a plan reads
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise HlatError(f"--rehearsal {path}: not a rehearsal (hlat rehearse --json): {e}") from None
    return data


def rehearsal_mismatch(data: dict, work: Workload, layout: Layout) -> str | None:
    """The fields in which the rehearsal's job differs from the planned one (its model's, sequence, batch,
    precision, FP8 recipe or layout), each 'field rehearsed (planned: value)', or None (a rehearsal written before
    `precision.fp8` ran none)."""

    def fields(model: ModelConfig, job: dict) -> dict:
        return {**{f"model.{k}": v for k, v in asdict(model).items()}, **job}

    theirs = fields(
        ModelConfig(**data["model_config"]),
        {
            "seq_len": data["seq_len"],
            "global_batch": data["global_batch"],
            "precision": data["precision"],
            "fp8": data.get("fp8", "none"),
            "micro_batch": data["micro_batch"],
            **data["parallel"],
        },
    )
    ours = fields(
        work.model,
        {
            "seq_len": work.seq_len,
            "global_batch": work.global_batch,
            "precision": work.precision,
            "fp8": work.fp8,
            "micro_batch": layout.micro_batch,
            **asdict(layout.parallel),
        },
    )
    differ = [
        f"{key} {value!r} (planned: {ours.get(key)!r})" for key, value in theirs.items() if ours.get(key) != value
    ]
    return "; ".join(differ) or None


def busiest(data: dict) -> dict:
    """The rehearsed rank that holds the most."""
    return max(data["ranks"], key=lambda r: rank_bytes(r))


def rank_bytes(rank: dict) -> float:
    memory = rank["memory"]
    activations = memory["activations"].get("step", memory["activations"])["measured"]
    return activations + sum(
        memory[k]["measured"] for k in ("params", "grads", "optimizer", "gathered", "parameter_casts")
    )


def with_rehearsal(plan, path: str) -> tuple:
    """`plan` (a `hlat.planner.search.Plan`) with the rehearsal's measured memory of its busiest rank in place of
    the composed one, and its measured compute too where it ran on the hardware planned; and what came from
    where, in words."""
    data = load_rehearsal(path)
    problem = rehearsal_mismatch(data, plan.work, plan.layout)
    if problem:
        raise HlatError(f"--rehearsal {path}: rehearsed a different job: {problem}")
    rank, hw = busiest(data), plan.hw
    memory = rank["memory"]
    measured = Memory(
        weights=memory["params"]["measured"],
        grads=memory["grads"]["measured"],
        optimizer=memory["optimizer"]["measured"],
        buffers=memory["gathered"]["measured"],
        activations=rank_bytes(rank) - sum(memory[k]["measured"] for k in ("params", "grads", "optimizer", "gathered")),
        overhead=hw.overhead_gib * GIB,
        capacity=hw.memory_gib * GIB,
    )
    ranks = ", ".join(str(r["rank"]) for r in data["ranks"])
    said = [f"memory rehearsed (ranks {ranks} of {data['world_size']:,}; the fullest, rank {rank['rank']})"]
    if data["hardware"] != hw.name:
        return replace(plan, memory=measured), said + [
            f"compute composed (rehearsed on {data['hardware']}, planned for {hw.name})"
        ]
    compute = max(r["time"]["step_compute_s"]["measured"] for r in data["ranks"])
    layout = plan.layout
    # the bubble runs (pp - 1) / v micro-batches' compute more: by the rehearsed figure, not the composed one
    bubble = (
        (layout.pp - 1)
        / layout.virtual_stages
        * (compute - plan.time.compute)
        / layout.microbatches(plan.work.global_batch)
    )
    time = replace(plan.time, compute=compute, bubble=plan.time.bubble + bubble, layer="rehearsed")
    return replace(plan, memory=measured, time=time), said + [f"compute rehearsed on {hw.name} (the slowest rank)"]
