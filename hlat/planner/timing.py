"""Time per optimizer step on the busiest pipeline stage.

Every term is a nominal time (FLOPs at peak rate, bytes at nominal bandwidth plus ring latencies) times a factor
of the profile's `[fit]`, so the total is piecewise linear in the factors and `hlat.planner.profiles.fit_factors`
can fit them to measurements:

    per layer        = max(layer_overhead,                                          (host: kernel launches)
                           FLOPs / peak x flops_factor                              (device: recomputation included)
                           + attention scores / HBM bandwidth x attention_factor    (materialised attention only)
                           + tensor-parallel all-reduces x intra/inter_factor)      (4 per layer, 6 with full recompute)
    per micro-batch  = layers x per layer + output layer
                     + pipeline sends of activations and gradients x intra/inter_factor + p2p_ms each
    step             = micro-batches x per micro-batch + pipeline bubble x per micro-batch of the other stages
                     + data-parallel gradient reduction x dp_factor                 (ZeRO-1: reduce-scatter + all-gather)
                     + optimizer step (memory-bound: state bytes / HBM bandwidth)

Where `hlat preflight` timed a whole block of the real model at exactly this workload's shape (tensor parallelism,
sequence parallelism, recomputation, micro-batch, sequence and precision mode: `hlat.planner.costs.block_shape`),
that time is the per-layer time, tensor-parallel communication included, and the measured rest of the micro-batch
(embedding, final norm, output layer and loss) replaces the output layer; under a pipeline the embedding's share
of it is the first stage's and the rest the last's. Otherwise the layer is composed from the
measured operations (`measured_layer`), and without those from the fitted factors; `StepTime.layer` says which.

The host launches kernels ahead of the device, so its fixed per-layer cost shows only where the device finishes a
layer sooner (small layers and micro-batches). Without fused attention the scores (micro-batch x heads x seq^2)
are written and read by a chain of memory-bound kernels (scale, mask, softmax, dropout, and again for the
recomputation and the backward pass); their cost grows with seq^2 where the matmuls' grows with seq x dim.

FSDP gathers the weights twice and reduce-scatters the gradients for every micro-batch; that traffic hides behind
the micro-batch's compute and only the excess is charged (no measurement used for the fits runs FSDP). Under a
pipeline schedule the trainer keeps FSDP's parameters gathered through the step and reduces the gradients once
(as torch's pipelining does), which costs what ZeRO-1 costs. With measured collectives the data-parallel traffic
is priced as `fully_shard` issues it (`data_parallel_time`): one collective per unit (each block, then the rest of
the stage) at that size's measured rate, the root unit gathered once per micro-batch, and the copies into and out of
its communication buffers, which replicated layouts pay too (the trainer runs them as fully_shard over a shard
group of one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hlat.models.config import ModelConfig
from hlat.planner.layout import Layout, Workload
from hlat.planner.memory import sharded_units, stage_params
from hlat.planner.costs import (attention_flops, block_shape, dp_block_shape, interpolate, layer_matmuls, loss_bytes,
                                 matmul_flops, memory_op_bytes, optimizer_bytes, output_matmul)
from hlat.planner.profiles import Fit, HardwareProfile


@dataclass(frozen=True)
class StepTime:
    compute: float  # seconds per step, all micro-batches of one stage
    tp_comm: float
    pp_comm: float
    bubble: float  # pipeline fill and drain
    dp_comm: float  # exposed data-parallel (or FSDP) communication
    optimizer: float
    layer: str = "fitted"  # how a layer was priced: "measured block", "composed" (measured operations) or "fitted"
    # how data parallelism was priced: "measured blocks" (timed under it), "composed" (measured collectives and
    # copies) or "fitted"; "" without data parallelism
    data_parallel: str = ""

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm + self.pp_comm + self.bubble + self.dp_comm + self.optimizer


def recompute_flops_per_token(model: ModelConfig, seq_len: int, recompute: str) -> float:
    """FLOPs per token spent again in the backward pass: the layers' forward for 'full', the attention core's
    forward (QK^T and AV) for 'selective'."""
    attention_core = 4.0 * model.n_layers * model.dim * seq_len
    if recompute == "full":
        return 2.0 * model.num_params(embedding=False) + attention_core
    return attention_core if recompute == "selective" else 0.0


def collective(hw: HardwareProfile, nbytes: float, group: int, per_node: int, passes: int) -> tuple[float, float]:
    """Nominal (intra-node, inter-node) seconds of a hierarchical ring collective over `group` devices, `per_node`
    of them in each node, on `nbytes` per device; `passes` is 2 for an all-reduce, 1 for an all-gather or a
    reduce-scatter. Across nodes every device of a node runs its group's collective at the same time, so the
    node's network bandwidth is shared by devices_per_node / per_node groups."""
    if group <= 1:
        return 0.0, 0.0
    g = min(per_node, group)
    k = group // g
    intra = inter = 0.0
    if g > 1:
        intra = passes * ((g - 1) / g * nbytes / (hw.intra_gbs * 1e9) + (g - 1) * hw.intra_latency_us * 1e-6)
    if k > 1:
        share = hw.inter_gbps / 8 * 1e9 * g / hw.devices_per_node
        inter = passes * ((k - 1) / k * nbytes / share + (k - 1) * hw.inter_latency_us * 1e-6)
    return intra, inter


def _rate(table: list[list[float]], size: float, unit: float) -> float:
    return interpolate(table, size) * unit


def measured_layer(work: Workload, layout: Layout, hw: HardwareProfile) -> tuple[float, float] | None:
    """Seconds of one layer and of the output layer (with the loss) for one micro-batch, composed from the
    profile's measurements: matmuls at their shapes' measured rates (forward, then twice that for backward, and
    the forward again under full recomputation), attention at the sequence length's rate, memory-bound bytes at
    measured bandwidths. None when the profile has no matmul measurements for the precision's compute dtype."""
    me, model, t = hw.measured, work.model, layout.tp
    fp32 = work.precision == "fp32"
    matmul, attention = (me.matmul_fp32, me.attention_fp32) if fp32 else (me.matmul_bf16, me.attention_bf16)
    if not matmul:
        return None
    tokens = work.seq_len * layout.micro_batch
    recompute = layout.activation_checkpoint
    passes = 4 if recompute == "full" else 3
    forward = sum(matmul_flops(s) / _rate(matmul, matmul_flops(s), 1e12)
                  for s in layer_matmuls(model, tokens, t).values())
    attn_flops = attention_flops(model, layout.micro_batch, work.seq_len, t)
    if attention:
        core = attn_flops / _rate(attention, work.seq_len, 1e12)
    else:
        core = attn_flops / (hw.peak_tflops * 1e12) * hw.fit.flops_factor
    core *= 4 / 3 if recompute != "none" else 1  # the forward again (selective recomputes just this)
    memory_bound = 0.0
    for op, nbytes in memory_op_bytes(model, tokens, t, layout.sequence_parallel, work.compute_bytes).items():
        gbs = getattr(me, f"{op}_gbs") or hw.hbm_gbs
        memory_bound += nbytes / (gbs * 1e9)
    memory_bound *= 1.4 if recompute == "full" else 1  # forward passes (2 of every 5 bytes) again
    out_shape = output_matmul(model, tokens, t)
    output = 3 * matmul_flops(out_shape) / _rate(matmul, matmul_flops(out_shape), 1e12)
    output += loss_bytes(model, tokens, t) / ((me.loss_gbs or hw.hbm_gbs) * 1e9)
    return forward * passes + core + memory_bound, output


def link_time(hw: HardwareProfile, fit: Fit, op: str, nbytes: float, group: int, per_node: int) -> float:
    """Seconds of a collective (`op`: all_reduce, all_gather or reduce_scatter) over `group` devices: within a node
    at the bus bandwidth preflight measured at that size where there is one, else nominal x intra_factor; across
    nodes nominal x inter_factor."""
    passes = 2 if op == "all_reduce" else 1
    intra, inter = collective(hw, nbytes, group, per_node, passes)
    table = getattr(hw.measured, op)
    g = min(per_node, group)
    if table and g > 1:
        intra = passes * (g - 1) / g * nbytes / _rate(table, nbytes, 1e9)
    else:
        intra *= fit.intra_factor
    return intra + inter * fit.inter_factor


def dp_collective(work: Workload, layout: Layout, hw: HardwareProfile, fit: Fit, op: str, bytes_per_param: float,
                  group: int, per_node: int, blocks: int = 1, rest: int = 1) -> float:
    """Seconds of the data-parallel collectives `op` over the stage's parameters as the trainer issues them, the
    blocks' `blocks` times and the rest of the stage's `rest` times. With measured bandwidths, one collective
    per `fully_shard` unit (each block, then the rest), each at its own size's measured rate; without, `blocks`
    messages of them all (what the fitted dp_factor was fitted to)."""
    if not getattr(hw.measured, op):
        return blocks * link_time(hw, fit, op, stage_params(work.model, layout) * bytes_per_param, group, per_node)
    return sum(times * count * link_time(hw, fit, op, params * bytes_per_param, group, per_node)
               for times, (count, params) in zip((blocks, rest), sharded_units(work.model, layout)))


def fsdp_copies(work: Workload, layout: Layout, hw: HardwareProfile, gathers: tuple[int, int],
                reductions: int) -> float:
    """Seconds `fully_shard` spends copying into and out of its flat communication buffers, at the measured
    bandwidth of a copy into a new buffer (else of elementwise work, else HBM's): a gather (`gathers`: of each
    block, and of the rest) copies the shard in (when there is more than one) and the whole unit out; a reduction
    copies the whole gradient in and its shard out (with one shard, a plain copy). Replicated layouts pay these
    too: the trainer runs them as fully_shard over a shard group of one."""
    mode, ds = work.mode, layout.dp_shard
    gather = 2 * (1 + (1 / ds if ds > 1 else 0)) * mode.weight_bytes  # bytes moved (read + write) per parameter
    reduce = 2 * (1 + 1 / ds) * mode.grad_bytes
    moved = sum(count * params * (times * gather + reductions * reduce)
                for times, (count, params) in zip(gathers, sharded_units(work.model, layout)))
    return moved / ((hw.measured.copy_gbs or hw.measured.residual_gbs or hw.hbm_gbs) * 1e9)


def step_time(work: Workload, layout: Layout, hw: HardwareProfile, fit: Fit | None = None) -> StepTime:
    fit = fit or hw.fit
    model, mode, cb = work.model, work.mode, work.compute_bytes
    t, p, v, dpn = layout.tp, layout.pp, layout.virtual_stages, hw.devices_per_node
    m = layout.microbatches(work.global_batch)
    layers = math.ceil(model.n_layers / p)
    tokens = work.seq_len * layout.micro_batch
    me = hw.measured

    # The busiest stage: its layers, and the output layer, which sits on the last stage (6 V h of the model's
    # FLOPs per token; the embedding lookup on the first costs no FLOPs).
    output_layer = 6.0 * model.vocab_size * model.dim
    block = me.block(block_shape(model, work.seq_len, layout.micro_batch, work.precision, t,
                                 layout.sequence_parallel, layout.activation_checkpoint))
    measured = block or measured_layer(work, layout, hw)
    embedding = 0.0  # on the first stage, where a measured block's ends say what it costs
    if measured:
        layer_device, output_time = measured[:2]
        if block and p > 1:
            embedding = block[2]
            output_time -= embedding
    else:
        per_layer = (model.flops_per_token(work.seq_len) - output_layer
                     + recompute_flops_per_token(model, work.seq_len, layout.activation_checkpoint)) / model.n_layers
        layer_device = per_layer * tokens / t / (hw.peak_tflops * 1e12) * fit.flops_factor
        if not hw.flash_attention:  # one nominal pass over the scores; the factor counts the passes
            scores = layout.micro_batch * model.n_heads / t * work.seq_len ** 2
            layer_device += scores * cb / (hw.hbm_gbs * 1e9) * fit.attention_factor
        output_time = output_layer * tokens / t / (hw.peak_tflops * 1e12) * fit.flops_factor

    tp_layer = 0.0
    if t > 1 and not block:  # all-reduces (or all-gather + reduce-scatter pairs with SP) of the full activation;
        # a tp group larger than a node runs them over the network (a measured block ran its own)
        collectives = 6 if layout.activation_checkpoint == "full" else 4
        tp_layer = collectives * link_time(hw, fit, "all_reduce", tokens * model.dim * cb, t, min(t, dpn))
    tp = layers * tp_layer
    # Host-bound layers (launch overhead above the device's work) are charged to compute; measured operations
    # were timed from the host, launches included.
    host_excess = 0.0 if measured else max(0.0, fit.layer_overhead_ms * 1e-3 - layer_device - tp_layer)
    compute = layers * (layer_device + host_excess) + output_time

    pp = 0.0
    if p > 1:  # each stage sends its tp shard of the activations forward and of their gradients backward
        msg = tokens * model.dim * cb / t
        if t * layout.dp >= dpn:  # a stage fills whole nodes: every device of a node sends across at once
            one = (msg * dpn / (hw.inter_gbps / 8 * 1e9) + hw.inter_latency_us * 1e-6) * fit.inter_factor
        elif me.send_recv:
            one = msg / _rate(me.send_recv, msg, 1e9)
        else:
            one = (msg / (hw.intra_gbs * 1e9) + hw.intra_latency_us * 1e-6) * fit.intra_factor
        pp = 2 * v * (one + fit.p2p_ms * 1e-3)

    dp_comm = measured_data_parallel(work, layout, hw, compute, m) if block else None
    dp_priced = "measured blocks"
    if dp_comm is None:
        dp_comm = data_parallel_time(work, layout, hw, fit, compute, m)
        dp_priced = "composed" if me.all_reduce else "fitted"

    # AdamW reads weights, gradients and states and writes weights and states, for the parameters it owns.
    owned = stage_params(model, layout) / layout.dp_shard
    optimizer = optimizer_bytes(owned, mode.weight_bytes, mode.grad_bytes, mode.optimizer_bytes) / (
        (me.optimizer_gbs or hw.hbm_gbs) * 1e9)

    # Filling and draining the pipeline runs through the stages before the last, which lack the output layer (the
    # first has the embedding instead).
    bubble = (p - 1) / v if p > 1 else 0.0
    return StepTime(compute=m * compute, tp_comm=m * tp, pp_comm=m * pp,
                    bubble=bubble * (compute - output_time + embedding + tp + pp),
                    dp_comm=dp_comm, optimizer=optimizer,
                    layer="measured block" if block else "composed" if measured else "fitted",
                    data_parallel=dp_priced if layout.dp > 1 else "")


def measured_data_parallel(work: Workload, layout: Layout, hw: HardwareProfile, compute: float,
                           m: int) -> float | None:
    """Exposed data-parallel time per step from blocks `hlat preflight` timed under the layout's own data
    parallelism (the same block shape, arrangement and data-parallel size, without a pipeline): the step's `m`
    micro-batches so wrapped (FSDP: each gathers and reduces; ZeRO-1 and DDP: the last reduces, the others
    accumulate) less the plain blocks' `compute` per micro-batch. None where preflight timed no such blocks."""
    if layout.dp == 1 or layout.pp > 1 or layout.sharding == "hsdp":
        return None
    model = work.model
    shape = block_shape(model, work.seq_len, layout.micro_batch, work.precision, layout.tp,
                        layout.sequence_parallel, layout.activation_checkpoint)
    per_micro_batch = []
    for accumulate in (False, layout.sharding != "fsdp"):
        timed = hw.measured.block(dp_block_shape(shape, layout.sharding, layout.dp, accumulate))
        if timed is None:
            return None
        per_micro_batch.append(model.n_layers * timed[0] + timed[1])
    last, others = per_micro_batch
    return max(0.0, last + (m - 1) * others - m * compute)


def data_parallel_time(work: Workload, layout: Layout, hw: HardwareProfile, fit: Fit, compute: float,
                       m: int) -> float:
    """Exposed data-parallel communication per step. The trainer overlaps it with computation: FSDP prefetches
    the next layer's gather and reduce-scatters during backward, every micro-batch; replicated and ZeRO-1 layouts
    reduce during the last micro-batch's backward (and ZeRO-1 gathers during the first forward). With a measured
    overlap (the share of a collective preflight saw hide behind concurrent compute) that share of the traffic,
    up to the compute it can hide behind, is free; without it FSDP hides fully and the rest is priced by the
    fitted dp_factor."""
    model, mode, dpn = work.model, work.mode, hw.devices_per_node
    params = stage_params(model, layout)
    dp_per_node = max(1, dpn // layout.tp)  # ranks are ordered tp, then dp, then pp
    ds, measured = layout.dp_shard, bool(hw.measured.all_reduce) and hw.measured.overlap >= 0
    overlap = hw.measured.overlap

    def exposed(traffic: float, hideable: float) -> float:
        return traffic - overlap * min(traffic, hideable)

    def raw(op: str, bytes_per_param: float, group: int, per_node: int) -> float:
        if measured:
            return dp_collective(work, layout, hw, fit, op, bytes_per_param, group, per_node)
        passes = 2 if op == "all_reduce" else 1
        return sum(collective(hw, params * bytes_per_param, group, per_node, passes)) * fit.dp_factor

    # Gathers per step of (each block, the rest): FSDP gathers a block before its forward and again before its
    # backward, every micro-batch, but keeps the root unit (the rest) from forward through backward; ZeRO-1 (and
    # any layout under a pipeline schedule) gathers once; a replicated layout reshards its blocks after each
    # forward but not after a backward that does not reduce, so the next forward finds them gathered.
    time, copies = 0.0, 0.0
    if layout.param_shard > 1 and layout.pp == 1:  # FSDP: gathered (as stored) and reduced every micro-batch
        per_mb = (dp_collective(work, layout, hw, fit, "all_gather", mode.weight_bytes, ds, dp_per_node, 2, 1)
                  + dp_collective(work, layout, hw, fit, "reduce_scatter", mode.grad_bytes, ds, dp_per_node))
        time = m * (exposed(per_mb, compute) if measured else max(0.0, per_mb - compute))
        copies = fsdp_copies(work, layout, hw, (2 * m, m), m)
    elif ds > 1:  # gathered once per step and kept (ZeRO-1, and FSDP under a pipeline schedule)
        traffic = (raw("reduce_scatter", mode.grad_bytes, ds, dp_per_node)
                   + raw("all_gather", mode.weight_bytes, ds, dp_per_node))
        time = exposed(traffic, compute) if measured else traffic
        copies = fsdp_copies(work, layout, hw, (1, 1), 1)
    elif layout.dp > 1:
        traffic = raw("all_reduce", mode.grad_bytes, layout.dp, dp_per_node)
        time = exposed(traffic, 2 / 3 * compute) if measured else traffic  # the last micro-batch's backward
        copies = fsdp_copies(work, layout, hw, (m + 1 if layout.pp == 1 else 1, 1), 1)
    # the copies are priced only with measured figures: the fitted factors were fitted to other trainers' runs
    time += copies if measured else 0.0
    if ds > 1 and layout.dp_replicate > 1:  # HSDP: the shards' gradients all-reduced across replicas, once
        time += raw("all_reduce", mode.grad_bytes / ds, layout.dp_replicate, max(1, dp_per_node // ds))
    return time
