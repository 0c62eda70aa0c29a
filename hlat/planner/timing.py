"""Time per optimizer step on the busiest pipeline stage.

Every term is a nominal time (FLOPs at peak rate, bytes at nominal bandwidth plus ring latencies) times a factor
of the profile's `[fit]`, so the total is piecewise linear in the factors and `hlat.planner.calibration.fit_factors`
can fit them to measurements:

    per layer        = max(layer_overhead,                                          (host: kernel launches)
                           FLOPs / peak x flops_factor                              (device: recomputation included)
                           + attention scores / HBM bandwidth x attention_factor    (materialised attention only)
                           + tensor-parallel all-reduces x intra/inter_factor)      (4 per layer, 6 with full recompute)
                     + context-parallel K/V all-gathers, reduce-scatters x link     (a rank: seq_len / cp tokens)
                     + expert-parallel all-to-alls x intra/inter_factor        (4 per layer, 6 with full recompute)
    per micro-batch  = layers x per layer + output layer
                     + pipeline sends of activations and gradients x intra/inter_factor + p2p_ms each
    step             = micro-batches x per micro-batch + pipeline bubble x per micro-batch of the other stages
                     + data-parallel gradient reduction x dp_factor                (ZeRO-1: reduce-scatter + all-gather)
                     + optimizer step (memory-bound: state bytes / HBM bandwidth)

Where `hlat preflight` timed a whole block of the real model at exactly this workload's shape (tensor parallelism,
sequence parallelism, recomputation, micro-batch, sequence, precision mode, and whether it was compiled:
`hlat.planner.costs.block_shape`), that time is the per-layer time, tensor-parallel communication included, and
the measured rest of the micro-batch (embedding, final norm, output layer and loss) replaces the output layer;
under a pipeline the embedding's share of it is the first stage's and the rest the last's. Otherwise the layer is
composed from the measured operations (`measured_layer`), and without those from the fitted factors;
`StepTime.layer` says which. A composed layer runs its memory-bound operations as the trainer does: eager, at the
rates preflight measured them (eager kernels, each a pass over its tensors); compiled (`parallel.compile`), fused,
so their nominal bytes stream at HBM bandwidth. With FP8 (`precision.fp8`) the blocks' linear layers are priced at
the rates preflight measured for the recipe (a torchao `Float8Linear`, forward + backward with its casts), the
output layer and attention at bf16's; without those rates the plan is refused (`check_fp8`): FP8 is never fitted.

The host launches kernels ahead of the device, so its fixed per-layer cost shows only where the device finishes a
layer sooner (small layers and micro-batches). Without fused attention the scores (micro-batch x heads x seq^2)
are written and read by a chain of memory-bound kernels (scale, mask, softmax, dropout, and again for the
recomputation and the backward pass); their cost grows with seq^2 where the matmuls' grows with seq x dim.

Communication (tensor-parallel collectives, pipeline sends, data-parallel traffic and what of it overlaps) is
priced in `hlat.planner.comms`. The pipeline bubble is that of torch.distributed.pipelining's Schedule1F1B and
ScheduleInterleaved1F1B, as the trainer runs them: (p - 1) / v micro-batches of a stage without the output layer
(tests/test_planner.py simulates both schedules' order of work and checks it). Pipeline sends are charged per
micro-batch, except where the profile's communication is hlat's own (measured with overlap, or cited) and the
schedule interleaves: the trainer's interleaved schedule hides them in its steady state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hlat import HlatError
from hlat.models.config import ModelConfig
from hlat.planner.comms import (
    context_parallel_time,
    data_parallel_time,
    expert_parallel_time,
    measured_data_parallel,
    pipeline_send_time,
    rate,
    sends_overlap,
    tensor_parallel_time,
)
from hlat.planner.costs import (
    attention_flops,
    block_linears,
    layer_matmuls,
    loss_bytes,
    matmul_flops,
    memory_op_bytes,
    optimizer_bytes,
    output_matmul,
)
from hlat.planner.layout import Layout, Workload
from hlat.planner.memory import stage_params
from hlat.profiles import Fit, HardwareProfile


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
    # copies), "cited" (published collective bandwidths) or "fitted"; "" without data parallelism
    data_parallel: str = ""
    cp_comm: float = 0.0  # context parallelism's gathers of keys and values and their gradients' reductions
    ep_comm: float = 0.0  # expert parallelism's all-to-alls of the experts' tokens and outputs

    @property
    def total(self) -> float:
        return (
            self.compute + self.tp_comm + self.cp_comm + self.ep_comm + self.pp_comm + self.bubble + self.dp_comm
        ) + self.optimizer


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch on the busiest pipeline stage, in seconds."""

    compute: float  # its layers, and the output layer (on the last stage)
    output: float  # the output layer's part of `compute`
    embedding: float  # what the first stage has instead of the output layer (known from measured blocks only)
    tp: float  # tensor-parallel collectives, on the critical path
    layer: str  # how a layer was priced (`StepTime.layer`)
    cp: float = 0.0  # context-parallel collectives, on the critical path
    ep: float = 0.0  # expert-parallel all-to-alls, on the critical path


def recompute_flops_per_token(model: ModelConfig, seq_len: int, recompute: str) -> float:
    """FLOPs per token spent again in the backward pass: the layers' forward for 'full' (a token's own experts),
    the attention core's forward (QK^T and AV) for 'selective'."""
    attention_core = 4.0 * model.n_layers * model.dim * seq_len
    if recompute == "full":
        return 2.0 * model.active_params(embedding=False) + attention_core
    return attention_core if recompute == "selective" else 0.0


def check_fp8(work: Workload, hw: HardwareProfile) -> None:
    """FP8 is priced from what preflight measured on the hardware and from nothing else: a plan with
    `precision.fp8` on a profile without the recipe's FP8 rates (and bf16's, for the rest of the layer) is refused
    in one line that says how to measure them."""
    me = hw.measured
    if work.fp8 == "none" or (me.fp8_matmul(work.fp8) and me.matmul_bf16):
        return
    missing = "bf16 matmul rate beside its FP8 ones" if me.fp8_matmul(work.fp8) else "FP8 matmul rate"
    raise HlatError(
        f"precision.fp8: {hw.name} has no measured {missing} ({work.fp8}); run `hlat preflight --config "
        "CONFIG --out measured.toml` on one of its GPUs (FP8 tensor cores, torchao installed) and pass "
        "the profile it writes with --hardware measured.toml"
    )


def linears_forward(
    work: Workload, matmul: list[list[float]], tokens: int, tp: int, hw: HardwareProfile, load: float = 1.0
) -> float:
    """Seconds of one layer's forward matmuls at their shapes' measured rates in the compute dtype (`matmul`); with
    FP8, each linear layer at its recipe's measured rate, whose forward + backward (casts included) was timed as
    one: a third of that time per pass."""
    if work.fp8 == "none":
        shapes, table = layer_matmuls(work.model, tokens, tp, load), matmul
    else:
        shapes, table = block_linears(work.model, tokens, tp), hw.measured.fp8_matmul(work.fp8)
    return sum(matmul_flops(s) / rate(table, matmul_flops(s), 1e12) for s in shapes.values())


def measured_layer(work: Workload, layout: Layout, hw: HardwareProfile) -> tuple[float, float] | None:
    """Seconds of one layer and of the output layer (with the loss) for one micro-batch, composed from the
    profile's measurements: matmuls at their shapes' measured rates (forward, then twice that for backward, and
    the forward again under full recomputation; FP8 linears at their recipe's), attention at the sequence length's
    rate, memory-bound bytes at measured bandwidths (compiled: HBM's). None when the profile has no matmul
    measurements for the precision's compute dtype."""
    me, model, t = hw.measured, work.model, layout.tp
    fp32 = work.precision == "fp32"
    matmul, attention = (me.matmul_fp32, me.attention_fp32) if fp32 else (me.matmul_bf16, me.attention_bf16)
    if not matmul:
        return None
    tokens = layout.held(work.seq_len) * layout.micro_batch
    recompute = layout.activation_checkpoint
    passes = 4 if recompute == "full" else 3
    load = work.load(layout)
    forward = linears_forward(work, matmul, tokens, t, hw, load)
    attn_flops = attention_flops(model, layout.micro_batch, work.seq_len, t, layout.cp)
    if attention:
        core = attn_flops / rate(attention, work.seq_len, 1e12)
    else:
        core = attn_flops / (hw.peak_tflops * 1e12) * hw.fit.flops_factor
    core *= 4 / 3 if recompute != "none" else 1  # the forward again (selective recomputes just this)
    memory_bound = 0.0  # compiled blocks fuse these operations: their nominal bytes stream at HBM bandwidth
    for op, nbytes in memory_op_bytes(model, tokens, t, layout.sequence_parallel, work.compute_bytes, load).items():
        gbs = hw.hbm_gbs if layout.parallel.compile else getattr(me, f"{op}_gbs") or hw.hbm_gbs
        memory_bound += nbytes / (gbs * 1e9)
    memory_bound *= 1.4 if recompute == "full" else 1  # forward passes (2 of every 5 bytes) again
    out_shape = output_matmul(model, tokens, t)
    output = 3 * matmul_flops(out_shape) / rate(matmul, matmul_flops(out_shape), 1e12)
    output += loss_bytes(model, tokens, t) / ((me.loss_gbs or hw.hbm_gbs) * 1e9)
    return forward * passes + core + memory_bound, output


def fitted_layer(work: Workload, layout: Layout, hw: HardwareProfile, fit: Fit) -> tuple[float, float]:
    """Seconds of one layer and of the output layer for one micro-batch from nominal FLOPs at peak x
    flops_factor (the output layer: 6 V h of the model's FLOPs per token; the embedding lookup costs none), and
    without fused attention the scores' passes x attention_factor."""
    model, t = work.model, layout.tp
    tokens = layout.held(work.seq_len) * layout.micro_batch
    output_layer = 6.0 * model.vocab_size * model.dim
    recompute = layout.activation_checkpoint
    # the busiest expert-parallel rank's experts run `load` x their share of the choices
    excess = model.n_layers * model.experts_per_token * (work.load(layout) - 1) * model.expert_params()
    per_layer = (
        model.flops_per_token(work.seq_len)
        - output_layer
        + recompute_flops_per_token(model, work.seq_len, recompute)
        + (8.0 if recompute == "full" else 6.0) * excess
    ) / model.n_layers
    layer = per_layer * tokens / t / (hw.peak_tflops * 1e12) * fit.flops_factor
    if not hw.flash_attention:  # one nominal pass over the scores; the factor counts the passes
        scores = layout.micro_batch * model.n_heads / t * layout.held(work.seq_len) * work.seq_len
        layer += scores * work.compute_bytes / (hw.hbm_gbs * 1e9) * fit.attention_factor
    return layer, output_layer * tokens / t / (hw.peak_tflops * 1e12) * fit.flops_factor


def layer_time(work: Workload, layout: Layout, hw: HardwareProfile, fit: Fit) -> tuple[float, float, float, str]:
    """(seconds of one layer, of the output layer, of the embedding, how the layer was priced) for one
    micro-batch: a measured block at exactly this shape, else composed from measured operations, else fitted. FP8
    needs its measured rates (`check_fp8`)."""
    check_fp8(work, hw)
    block = hw.measured.block(layout.block_shape(work))
    if block:
        layer, ends, embedding = block
        embedding = embedding if layout.pp > 1 else 0.0
        return layer, ends - embedding, embedding, "measured block"
    composed = measured_layer(work, layout, hw)
    if composed:
        return *composed, 0.0, "composed"
    return *fitted_layer(work, layout, hw, fit), 0.0, "fitted"


def micro_batch(work: Workload, layout: Layout, hw: HardwareProfile, fit: Fit) -> MicroBatch:
    """One micro-batch on the busiest stage: its layers, the output layer, and the tensor-parallel collectives
    (which a measured block ran itself). Host-bound layers (launch overhead above the device's work) are
    charged to compute where the layer is fitted; measured operations were timed from the host, launches
    included."""
    layers = math.ceil(work.model.n_layers / layout.pp)
    layer, output, embedding, how = layer_time(work, layout, hw, fit)
    tp = 0.0 if how == "measured block" else tensor_parallel_time(work, layout, hw, fit)
    cp = context_parallel_time(work, layout, hw, fit)
    ep = expert_parallel_time(work, layout, hw, fit)
    host_excess = max(0.0, fit.layer_overhead_ms * 1e-3 - layer - tp - cp - ep) if how == "fitted" else 0.0
    return MicroBatch(
        compute=layers * (layer + host_excess) + output,
        output=output,
        embedding=embedding,
        tp=layers * tp,
        layer=how,
        cp=layers * cp,
        ep=layers * ep,
    )


def optimizer_time(work: Workload, layout: Layout, hw: HardwareProfile) -> float:
    """The optimizer step over the parameters a device owns: AdamW's bytes at the measured update's rate (else
    HBM bandwidth). The pure-bf16 modes' BF16AdamW takes its own measured rate where the profile has one. An
    update larger than the one preflight timed pays that one's time and streams the rest at HBM bandwidth."""
    me, mode = hw.measured, work.mode
    owned = stage_params(work.model, layout) / layout.shards
    nbytes = optimizer_bytes(owned, mode.weight_bytes, mode.grad_bytes, mode.optimizer_bytes)
    if mode.optimizer == "BF16AdamW" and me.bf16_optimizer_gbs:
        return nbytes / (me.bf16_optimizer_gbs * 1e9)
    timed = me.optimizer_measured_bytes if me.optimizer_gbs else 0.0
    if timed and nbytes > timed:
        return timed / (me.optimizer_gbs * 1e9) + (nbytes - timed) / (hw.hbm_gbs * 1e9)
    return nbytes / ((me.optimizer_gbs or hw.hbm_gbs) * 1e9)


def step_time(work: Workload, layout: Layout, hw: HardwareProfile, fit: Fit | None = None) -> StepTime:
    fit = fit or hw.fit
    m = layout.microbatches(work.global_batch)
    mb = micro_batch(work, layout, hw, fit)
    pp = pipeline_send_time(work, layout, hw, fit)
    dp_comm = measured_data_parallel(work, layout, hw, mb.compute, m) if mb.layer == "measured block" else None
    dp_priced = "measured blocks"
    if dp_comm is None:
        dp_comm = data_parallel_time(work, layout, hw, fit, mb.compute, m)
        dp_priced = "composed" if hw.measured.all_reduce else "cited" if hw.links.source else "fitted"
    # Filling and draining the pipeline runs through the stages before the last, which lack the output layer (the
    # first has the embedding instead).
    bubble = (layout.pp - 1) / layout.virtual_stages
    pp_comm, bubble_pp = m * pp, pp
    if layout.pp_schedule == "interleaved_1f1b" and sends_overlap(hw):
        # the trainer's interleaved schedule posts each receive as early as it can: in the steady state the
        # transfers hide behind other chunks' work, and only the chain through every chunk, forward and back,
        # waits for them (vp - 1 hops each way)
        pp_comm, bubble_pp = pp / layout.virtual_stages * (layout.virtual_stages * layout.pp - 1), 0.0
    return StepTime(
        compute=m * mb.compute,
        tp_comm=m * mb.tp,
        pp_comm=pp_comm,
        bubble=bubble * (mb.compute - mb.output + mb.embedding + mb.tp + mb.cp + mb.ep + bubble_pp),
        dp_comm=dp_comm,
        optimizer=optimizer_time(work, layout, hw),
        layer=mb.layer,
        data_parallel=dp_priced if layout.shards * layout.dp_replicate > 1 else "",
        cp_comm=m * mb.cp,
        ep_comm=m * mb.ep,
    )
