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

The host launches kernels ahead of the device, so its fixed per-layer cost shows only where the device finishes a
layer sooner (small layers and micro-batches). Without fused attention the scores (micro-batch x heads x seq^2)
are written and read by a chain of memory-bound kernels (scale, mask, softmax, dropout, and again for the
recomputation and the backward pass); their cost grows with seq^2 where the matmuls' grows with seq x dim.

FSDP gathers the weights twice and reduce-scatters the gradients for every micro-batch; that traffic hides behind
the micro-batch's compute and only the excess is charged (no measurement used for the fits runs FSDP). Under a
pipeline schedule the trainer keeps FSDP's parameters gathered through the step and reduces the gradients once
(as torch's pipelining does), which costs what ZeRO-1 costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hlat.models.config import ModelConfig
from hlat.planner.layout import Layout, Workload
from hlat.planner.memory import stage_params
from hlat.planner.profiles import Fit, HardwareProfile


@dataclass(frozen=True)
class StepTime:
    compute: float  # seconds per step, all micro-batches of one stage
    tp_comm: float
    pp_comm: float
    bubble: float  # pipeline fill and drain
    dp_comm: float  # exposed data-parallel (or FSDP) communication
    optimizer: float

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


def step_time(work: Workload, layout: Layout, hw: HardwareProfile, fit: Fit | None = None) -> StepTime:
    fit = fit or hw.fit
    model, mode, cb = work.model, work.mode, work.compute_bytes
    t, p, v, dpn = layout.tp, layout.pp, layout.virtual_stages, hw.devices_per_node
    m = layout.microbatches(work.global_batch)
    layers = math.ceil(model.n_layers / p)
    tokens = work.seq_len * layout.micro_batch

    def link(intra_inter: tuple[float, float]) -> float:
        return intra_inter[0] * fit.intra_factor + intra_inter[1] * fit.inter_factor

    # The busiest stage: its layers, and the output layer, which sits on the last stage (6 V h of the model's
    # FLOPs per token; the embedding lookup on the first costs no FLOPs).
    output_layer = 6.0 * model.vocab_size * model.dim
    per_layer = (model.flops_per_token(work.seq_len) - output_layer
                 + recompute_flops_per_token(model, work.seq_len, layout.activation_checkpoint)) / model.n_layers
    layer_device = per_layer * tokens / t / (hw.peak_tflops * 1e12) * fit.flops_factor
    if not hw.flash_attention:  # one nominal pass over the scores; the factor counts the passes
        scores = layout.micro_batch * model.n_heads / t * work.seq_len ** 2
        layer_device += scores * cb / (hw.hbm_gbs * 1e9) * fit.attention_factor

    tp_layer = 0.0
    if t > 1:  # all-reduces (or all-gather + reduce-scatter pairs with SP) of the full activation; a tp group
        # larger than a node runs them over the network
        collectives = 6 if layout.activation_checkpoint == "full" else 4
        tp_layer = collectives * link(collective(hw, tokens * model.dim * cb, t, min(t, dpn), passes=2))
    tp = layers * tp_layer
    # Host-bound layers (launch overhead above the device's work) are charged to compute.
    host_excess = max(0.0, fit.layer_overhead_ms * 1e-3 - layer_device - tp_layer)
    output_time = output_layer * tokens / t / (hw.peak_tflops * 1e12) * fit.flops_factor
    compute = layers * (layer_device + host_excess) + output_time

    pp = 0.0
    if p > 1:  # each stage sends its tp shard of the activations forward and of their gradients backward
        msg = tokens * model.dim * cb / t
        if t * layout.dp >= dpn:  # a stage fills whole nodes: every device of a node sends across at once
            one = (msg * dpn / (hw.inter_gbps / 8 * 1e9) + hw.inter_latency_us * 1e-6) * fit.inter_factor
        else:
            one = (msg / (hw.intra_gbs * 1e9) + hw.intra_latency_us * 1e-6) * fit.intra_factor
        pp = 2 * v * (one + fit.p2p_ms * 1e-3)

    params = stage_params(model, layout)
    dp_per_node = max(1, dpn // t)  # ranks are ordered tp, then dp, then pp
    dp_comm = 0.0
    ds = layout.dp_shard
    if layout.param_shard > 1 and p == 1:  # FSDP: gathered (as stored) twice per micro-batch
        gather = collective(hw, params * mode.weight_bytes, ds, dp_per_node, passes=1)
        scatter = collective(hw, params * mode.grad_bytes, ds, dp_per_node, passes=1)
        per_mb = 2 * link(gather) + link(scatter)
        dp_comm = m * max(0.0, per_mb - compute)
    elif ds > 1:  # gathered once per step and kept (ZeRO-1, and FSDP under a pipeline schedule)
        nominal = (sum(collective(hw, params * mode.grad_bytes, ds, dp_per_node, passes=1))
                   + sum(collective(hw, params * mode.weight_bytes, ds, dp_per_node, passes=1)))
        dp_comm = nominal * fit.dp_factor
    elif layout.dp > 1:
        dp_comm = sum(collective(hw, params * mode.grad_bytes, layout.dp, dp_per_node, passes=2)) * fit.dp_factor
    if ds > 1 and layout.dp_replicate > 1:  # HSDP: the shards' gradients all-reduced across replicas, once
        reduce = collective(hw, params / ds * mode.grad_bytes, layout.dp_replicate, max(1, dp_per_node // ds),
                            passes=2)
        dp_comm += sum(reduce) * fit.dp_factor

    # AdamW reads weights, gradients and states and writes weights and states, for the parameters it owns.
    owned = params / layout.dp_shard
    optimizer = owned * (2 * mode.weight_bytes + mode.grad_bytes + 2 * mode.optimizer_bytes) / (hw.hbm_gbs * 1e9)

    # Filling and draining the pipeline runs through the stages before the last, which lack the output layer.
    bubble = (p - 1) / v if p > 1 else 0.0
    return StepTime(compute=m * compute, tp_comm=m * tp, pp_comm=m * pp,
                    bubble=bubble * (compute - output_time + tp + pp),
                    dp_comm=dp_comm, optimizer=optimizer)
