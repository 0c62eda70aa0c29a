"""Memory per device: model states by precision mode and sharding, activations by recomputation, sequence
parallelism and pipeline schedule (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models"), and a fixed framework overhead. Everything is for the busiest device: the first pipeline
stage, which holds the most micro-batches in flight, charged with what the last stage's head keeps as well (the
final norm, and the loss's gradients computed in forward or, without chunks, the output projection's input and the
logits)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hlat.models.config import ModelConfig
from hlat.planner.layout import Layout, Workload
from hlat.profiles import HardwareProfile

GIB = 2**30


@dataclass(frozen=True)
class Memory:
    weights: float  # bytes per device
    grads: float
    optimizer: float
    activations: float
    buffers: float  # FSDP's unsharded parameters and gradients (of the layers in flight, or all under a pipeline)
    overhead: float
    capacity: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.buffers + self.overhead

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def shortfall(self) -> str:
        """What does not fit, in words ('' when it fits)."""
        if self.fits:
            return ""
        parts = {"model states": self.weights + self.grads + self.optimizer, "activations": self.activations}
        worst = max(parts, key=parts.get)
        return (
            f"needs {self.total / GIB:.1f} GiB of {self.capacity / GIB:.0f} GiB per device "
            f"({worst} {parts[worst] / GIB:.1f} GiB)"
        )


def layer_params_per_device(model: ModelConfig, tp: int, ep: int = 1) -> float:
    """One transformer layer's parameters on one tensor-parallel rank, as `hlat.parallel.tensor` shards them: the
    matrices split over tp (the column-parallel ones with their biases), the norms and the row-parallel biases
    whole on every rank. When tp exceeds the kv heads every rank keeps the whole K and V projections (they are
    replicated, then each rank keeps the head its query heads use). A mixture of experts' router is whole on every
    rank, each expert split over tp, and `ep` ranks share the experts (`hlat.parallel.experts`): a rank holds
    n_experts / ep of them whole before FSDP shards them, and all of them / (ep x ep_shard) = / (dp_shard x cp) as
    stored, the same share as the rest of the block."""
    d, kv_out = model.dim, 2 * model.kv_heads * model.head_dim
    if model.moe:
        experts = model.n_experts // ep * model.expert_params() / tp
        return block_linear_weights(model, tp) + model.n_experts * d + experts + 2 * d
    if model.family == "llama":  # no biases; the RMSNorm weights
        return block_linear_weights(model, tp) + 2 * d
    biases = (d + model.ffn_dim) / tp + (kv_out if model.kv_heads % tp else kv_out / tp)  # wq's, w1's; wk's, wv's
    return block_linear_weights(model, tp) + biases + 4 * d + 2 * d  # LayerNorms' weights and biases; wo's, w2's


def block_linear_weights(model: ModelConfig, tp: int) -> float:
    """The weights (without biases) of one layer's linear layers on one tensor-parallel rank: wq, wk, wv, wo and
    the MLP's (none of a mixture of experts: its experts are not linear layers), what FP8 training converts (K and
    V whole on every rank when tp exceeds the kv heads)."""
    d, f, kv = model.dim, model.ffn_dim, 2 * model.kv_heads * model.head_dim * model.dim
    split = 2 * d * d + (0 if model.moe else 3 if model.family == "llama" else 2) * d * f  # wq, wo, the MLP
    return split / tp + (kv if model.kv_heads % tp else kv / tp)


def stage_params(model: ModelConfig, layout: Layout) -> float:
    """Parameters on one device of the largest pipeline stage (the embedding on the first stage, the output
    projection and the final norm on the last; with one stage all of them, the embedding counted once when
    tied)."""
    layers = math.ceil(model.n_layers / layout.pp)
    embedding = model.embedding_params() if layout.pp == 1 else model.vocab_size * model.dim
    final_norm = model.num_params(embedding=False) - model.n_layers * model.layer_params()
    return layers * layer_params_per_device(model, layout.tp) + embedding / layout.tp + final_norm


def sharded_units(model: ModelConfig, layout: Layout) -> list[tuple[int, float]]:
    """(count, parameters per device) of the units `fully_shard` wraps on the largest stage (see
    `hlat.parallel.data`): each block, then the rest of the stage. Data parallelism runs one gather or reduction
    per unit, each at that unit's size."""
    layers = math.ceil(model.n_layers / layout.pp)
    block = layer_params_per_device(model, layout.tp, layout.ep)  # what a block gathers
    return [(layers, block), (1, stage_params(model, layout) - layers * layer_params_per_device(model, layout.tp))]


def layer_activation_bytes(
    model: ModelConfig,
    seq_len: int,
    layout: Layout,
    recompute: str,
    act_bytes: int,
    flash: bool,
    stack: str = "hlat",
    stream_bytes: int = 0,
    norm_bytes: int = 0,
    expert_load: float = 1.0,
) -> float:
    """Bytes one layer keeps for the backward pass of one micro-batch on one device, in tensors of s x b x h
    elements (s: one of them; under context parallelism s counts the rank's share of the sequence, and attention
    keeps every rank's K and V: `kv_bytes`). Without fused (flash) attention the softmax output (s / h of them,
    split by tp) is kept too when nothing is recomputed. 'full' recomputation keeps the block's input only.

    `stack` "hlat": what hlat's model keeps, as `tests/test_activation_memory.py` counts it in the real model.
    - 'none': each norm keeps its input and output (RMSNorm also the normalised input, for its weight's
      gradient); attention keeps Q, K, V after rotary and its output; the MLP keeps 4 f-wide tensors (SwiGLU) or
      2 (GeLU). Under sequence parallelism the norms run on a sequence shard and their outputs are kept as the
      projections' all-gathered inputs, at full size (torch's tensor parallelism keeps them; Megatron gathers
      them again in backward). For the neox family without sequence parallelism this is Korthikanti et al.'s.
    - 'selective' (hlat keeps the matmul and collective outputs and recomputes the rest): the block's input,
      the column-parallel outputs (Q, K, V, the MLP's input projections), the row-parallel outputs before their
      reduction (full size), and the collectives' outputs (all-reduces; or all-gathers and reduce-scatters).

    `stack` "megatron" (Megatron-LM, NeuronX Distributed): Korthikanti et al. 2022, generalised to grouped-query
    attention and either MLP, without dropout: 4 outside the tensor-parallel region (norm inputs and outputs),
    split only by sequence parallelism; Q, K, V, the attention output and the MLP's intermediates split by tp;
    'selective' recomputes only the attention core.

    `stream_bytes` (default `act_bytes`): the residual stream's element size, the parameters' under mixed
    precision (bf16_mixed: fp32): the blocks' inputs, the norms and, under sequence parallelism, the all-gathers of
    their outputs are in it; what autocast casts for a matmul (its saved input) and what the matmuls produce are
    in `act_bytes`. `norm_bytes` (default `stream_bytes`): the element size of what a norm keeps (`norm_bytes`). A
    mixture-of-experts block: `moe_block_bytes`, its experts taking `expert_load` x an even share of the choices."""
    t, cp, s = layout.tp, layout.cp, layout.held(seq_len) * layout.micro_batch * model.dim * act_bytes
    # one tensor of the residual stream (Megatron-style stacks keep it in the compute dtype)
    r, sp = s * (stream_bytes or act_bytes) / act_bytes if stack == "hlat" else s, t if layout.sequence_parallel else 1
    if recompute == "full":
        return r / sp
    kv, f, llama = model.kv_heads / model.n_heads, model.ffn_dim / model.dim, model.family == "llama"
    scores = model.n_heads * seq_len / model.dim * s / t if recompute == "none" and not flash else 0.0
    norms = 2 * (2 if llama else 1) * r * (norm_bytes or stream_bytes or act_bytes) / (stream_bytes or act_bytes)
    if model.moe:
        return moe_block_bytes(model, layout, recompute, stack, (s, r, norms, scores), act_bytes, expert_load)
    inside = (2 + 2 * kv * cp + (4 if llama else 2) * f) * s / t  # K and V: every context-parallel rank's
    if stack == "megatron":
        return 4 * s / sp + inside + scores
    inside += kv_bytes(model, t, recompute, s, cp) - 2 * kv * cp * s / t
    if recompute == "selective":
        kept = r / sp + (1 + (2 if llama else 1) * f) * s / t + kv_bytes(model, t, recompute, s, cp) + 2 * s
        if t > 1:  # the collectives' outputs: all-reduces, or the norms' gathered outputs and reduce-scatters
            kept += 2 * r + 2 * s / t if layout.sequence_parallel else 2 * s
        return kept
    # a norm's output is kept by the projections after it (under SP all-gathered, at full size); under mixed
    # precision each projection keeps its own cast of it (Q, K and V; both or the one MLP input projection)
    inputs = (3 + (2 if llama else 1)) * s if r != s else 2 * s
    return norms / sp + inputs + inside + scores


def moe_block_bytes(
    model: ModelConfig,
    layout: Layout,
    recompute: str,
    stack: str,
    tensors: tuple[float, ...],
    act_bytes: int,
    expert_load: float,
) -> float:
    """A mixture-of-experts block's `layer_activation_bytes` under none or selective recomputation (`tensors`: s, r,
    norms and scores as there): its norms, its attention as a dense block's, recomputed alone under selective
    (`hlat.parallel.recompute`: the region's input, Q's projection, K and V's, wo's output and its reduction kept),
    and its MLP kept whole: the router's input (its cast of this rank's sequence shard under mixed precision, else
    the norm's output it reads) and the experts' tensors (`experts_bytes`). A Megatron-style stack: its attention
    as Korthikanti et al.'s, and the experts."""
    s, r, norms, scores = tensors
    t, cp, mixed = layout.tp, layout.cp, r != s
    experts = experts_bytes(model, layout, s, act_bytes, expert_load)
    sp = t if layout.sequence_parallel else 1
    if stack == "megatron":
        return 4 * s / sp + (2 + 2 * model.kv_heads / model.n_heads * cp) * s / t + scores + experts
    router = s / t if mixed else s / sp
    if recompute == "selective":
        reduced = (s / t if layout.sequence_parallel else s) if t > 1 else 0.0
        attention = r + s / t + kv_bytes(model, t, recompute, s, cp) + s + reduced
    else:  # each projection's cast of its input (or the input), Q (and K) after rotary, the attention's output
        attention = (3 * s if mixed else s) + 2 * s / t + kv_bytes(model, t, recompute, s, cp) + scores
    return norms / sp + attention + router + experts


def experts_bytes(model: ModelConfig, layout: Layout, s: float, act_bytes: int, load: float) -> float:
    """What a mixture-of-experts MLP keeps of one micro-batch besides the router's input, as `hlat.models.moe` keeps
    it (`s`: one tensor of the micro-batch's tokens this rank holds x dim, in act_bytes): per choice its experts
    take (experts_per_token x `load` of every token it routes, every tensor-parallel shard's) the token cast for
    them and the four ffn_dim / tp wide tensors of the expert's SwiGLU; per choice of those tokens its expert's
    output (whole dim: a partial sum under tensor parallelism); per token the router's probabilities (fp32, of this
    rank's sequence shard), the choices' weights and the routing's indices (int64), in `small` bytes."""
    t, k, d = layout.tp, model.experts_per_token, model.dim
    expert_side = k * load * (1 + 4 * model.ffn_dim / (d * t)) * s
    small = (4 * model.n_experts + 12 * k + 4) / t + 20 * k + (16 * k * load if layout.ep > 1 else 0)
    return expert_side + k * s + small / (d * act_bytes) * s


def kv_bytes(model: ModelConfig, tp: int, recompute: str, s: float, cp: int = 1) -> float:
    """What a layer keeps of K and V on one rank ('none': after rotary; 'selective': the projections' outputs).
    With more tensor-parallel ranks than kv heads every rank computes all of them (`replicate_kv_heads`) and
    keeps one head's: rotary makes K's its own, but V's is a view that holds the whole projection (and under
    selective recomputation both projections are kept whole). Under context parallelism attention keeps every
    cp rank's K and V of its heads as gathered (in place of its own after rotary), and selective recomputation
    keeps the gather's output beside the projections'."""
    head = model.head_dim / model.dim * s
    gathered = 2 * cp * head * (model.kv_heads / tp if model.kv_heads % tp == 0 else 1)
    if cp > 1 and recompute == "none":
        return gathered
    extra = gathered if cp > 1 else 0.0
    if model.kv_heads % tp == 0:
        return 2 * model.kv_heads / model.n_heads * s / tp + extra
    return (2 * model.kv_heads * head if recompute == "selective" else (1 + model.kv_heads) * head) + extra


def in_flight(layout: Layout, microbatches: int) -> float:
    """Micro-batches whose activations the first stage holds at once, in units of its whole stage."""
    p, v = layout.pp, layout.virtual_stages
    if p == 1:
        return 1.0
    if layout.pp_schedule == "gpipe":
        return microbatches
    if layout.pp_schedule == "interleaved_1f1b":
        return min(microbatches, p + (p - 1) / v)  # Korthikanti: L (1 + (p - 1) / (p v)) layers' worth
    return min(microbatches, p)


def head_bytes(work: Workload, layout: Layout, microbatches: int, stack: str = "hlat", norm_bytes: int = 0) -> float:
    """What the last stage's head keeps for backward, for each micro-batch between its forward and its backward
    there (every one under GPipe, one under the 1F1B schedules and without a pipeline): the final norm's input and
    output (on a sequence shard under sequence parallelism, like a block's norms), and with the chunked loss
    (`model.loss_chunk`) the gradients it computed in forward, for the output projection's input (every token, in
    the residual stream's dtype) and for the output weight (its vocabulary rows, fp32); with the whole logits
    (`loss_chunk = 0`) the output projection's input (all-gathered under sequence parallelism) and the logits
    (vocabulary-parallel across tp) in the compute dtype and in fp32 for the loss. A Megatron-style stack: the
    one micro-batch's logits. `norm_bytes` (default the residual stream's): the element size of what the norm
    keeps (`norm_bytes`)."""
    model, t = work.model, layout.tp
    tokens = layout.held(work.seq_len) * layout.micro_batch
    if stack != "hlat":
        return (work.compute_bytes + 4) * tokens * model.vocab_size / t
    s, r = tokens * model.dim * work.compute_bytes, tokens * model.dim * work.mode.weight_bytes
    norm = (2 if model.family == "llama" else 1) * tokens * model.dim * (norm_bytes or work.mode.weight_bytes)
    norm /= t if layout.sequence_parallel else 1
    if model.loss_chunk:
        loss = r + 4 * model.vocab_size * model.dim / t
    else:
        loss = s + (work.compute_bytes + 4) * tokens * model.vocab_size / t
    waiting = microbatches if layout.pp > 1 and layout.pp_schedule == "gpipe" else 1
    return waiting * (norm + loss)


def blocks_activation_bytes(work: Workload, layout: Layout, hw: HardwareProfile, layers: float) -> float:
    """What `layers` blocks' worth of micro-batches in flight keep for backward (`layer_activation_bytes` in
    the profile's stack)."""
    return layers * layer_activation_bytes(
        work.model,
        work.seq_len,
        layout,
        layout.activation_checkpoint,
        work.compute_bytes,
        hw.flash_attention,
        hw.activations,
        work.mode.weight_bytes,
        norm_bytes(work, hw),
        work.load(layout),
    )


def rebuilt_bytes(work: Workload, layout: Layout, hw: HardwareProfile) -> float:
    """Under full recomputation, the one block rebuilt at a time in backward (none otherwise)."""
    if layout.activation_checkpoint != "full":
        return 0.0
    rebuilt = "none" if hw.activations == "hlat" else "selective"  # Megatron recomputes without the scores
    return layer_activation_bytes(
        work.model,
        work.seq_len,
        layout,
        rebuilt,
        work.compute_bytes,
        hw.flash_attention,
        hw.activations,
        work.mode.weight_bytes,
        norm_bytes(work, hw),
        work.load(layout),
    )


def norm_bytes(work: Workload, hw: HardwareProfile) -> int:
    """The element size of what a norm keeps for backward (its input and its normalised result): the residual
    stream's, but at least fp32 for RMSNorm off CUDA, where torch composes it from operations that run a bf16
    input in fp32 and keep the fp32 tensors (as a rehearsal on the CPU measures; on CUDA torch has a fused
    kernel, whose saved input keeps the stream's dtype)."""
    stream = work.mode.weight_bytes
    return max(4, stream) if work.model.family == "llama" and hw.accelerator != "gpu" else stream


def mask_bytes(work: Workload, layout: Layout, hw: HardwareProfile) -> float:
    """The attention mask of one micro-batch, made once for all its layers, as hlat's model makes it: where
    attention takes a dense mask (off CUDA, whose FlexAttention takes a block mask of a few bytes per 128 x 128
    block) and there is one (packed documents, or context parallelism: the rank's queries against every key), in
    the compute dtype."""
    if hw.accelerator == "gpu" or hw.activations != "hlat" or not (work.model.doc_mask or layout.cp > 1):
        return 0.0
    return layout.micro_batch * layout.held(work.seq_len) * work.seq_len * work.compute_bytes


def cast_bytes(work: Workload, layout: Layout, layers: int, output: bool) -> float:
    """bf16_mixed: the bf16 copy autocast makes of every parameter a matmul reads (`layers` blocks' but their
    norms, and with the whole logits, `model.loss_chunk = 0`, the output projection's: the chunked loss casts it
    for its forward alone), kept for backward by the forward passes that share it (a step's, under a pipeline
    schedule; one micro-batch's otherwise). A mixture of experts casts its experts' weights itself, kept by the
    matmuls that read them; without a pipeline, only what autograd keeps: none under full recomputation, and under
    selective (which recomputes its attention alone) the router's and the experts'."""
    if work.precision != "bf16_mixed":
        return 0.0
    model, bf16 = work.model, 2
    norms = (2 if model.family == "llama" else 4) * model.dim
    projection = model.vocab_size * model.dim / layout.tp if output and not model.loss_chunk else 0.0
    block = layer_params_per_device(model, layout.tp, layout.ep) - norms
    if model.moe and layout.pp == 1:
        recompute = layout.activation_checkpoint
        attention = block_linear_weights(model, layout.tp)
        block = 0.0 if recompute == "full" else block - attention if recompute == "selective" else block
    return bf16 * (layers * block + projection)


def memory(work: Workload, layout: Layout, hw: HardwareProfile) -> Memory:
    model, mode = work.model, work.mode
    params = stage_params(model, layout)
    shard = layout.param_shard
    opt_shard = layout.shards  # FSDP's and ZeRO-1's

    layers = math.ceil(model.n_layers / layout.pp)
    m = layout.microbatches(work.global_batch)
    activations = blocks_activation_bytes(work, layout, hw, layers * in_flight(layout, m))
    activations += mask_bytes(work, layout, hw) * in_flight(layout, m)
    activations += rebuilt_bytes(work, layout, hw)
    activations += head_bytes(work, layout, m, hw.activations, norm_bytes(work, hw))
    if hw.activations == "hlat":  # torch's autocast (other stacks cast their own way)
        activations += cast_bytes(work, layout, layers, output=True)

    buffers = 0.0
    if shard > 1 and layout.pp > 1:
        # Under a pipeline schedule the trainer keeps FSDP's parameters gathered (beside their shards) through
        # the step, and the gradients accumulate unsharded until the last micro-batch.
        buffers = params * (mode.weight_bytes + mode.grad_bytes * (1 - 1 / shard))
    elif shard > 1:  # the layer being computed and the one prefetched, gathered; one layer's full gradients
        buffers = (2 * mode.weight_bytes + mode.grad_bytes) * layer_params_per_device(model, layout.tp, layout.ep)
    return Memory(
        weights=params * mode.weight_bytes / shard,
        grads=params * mode.grad_bytes / shard,
        optimizer=params * mode.optimizer_bytes / opt_shard,
        activations=activations,
        buffers=buffers,
        overhead=hw.overhead_gib * GIB,
        capacity=hw.memory_gib * GIB,
    )
