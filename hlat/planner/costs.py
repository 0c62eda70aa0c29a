"""The work of one transformer layer, as `hlat preflight` measures it and the step-time model prices it: the
layer's matmul shapes, its attention, and the nominal bytes of its memory-bound operations (forward and backward).

One definition serves both sides: preflight times an operation at the model's own shapes and stores a rate
(TFLOP/s, or GB/s of these nominal bytes); the planner divides the same nominal quantities by the stored rate,
so a shape preflight measured is priced at exactly its measured time, and other shapes scale from the nearest."""

from __future__ import annotations

import bisect
import math

from hlat.models.config import ModelConfig


def layer_matmuls(model: ModelConfig, tokens: int, tp: int, load: float = 1.0) -> dict[str, tuple[int, int, int]]:
    """Forward matmuls of one layer on one tensor-parallel rank, as (rows, inner, columns). A mixture of experts'
    router runs on the rank's sequence shard, and its experts' matmuls on the choices they take (experts_per_token x
    `load` of every token: `hlat.planner.layout.Workload.load`), one grouped matmul each."""
    d, hd, f = model.dim, model.head_dim, model.ffn_dim
    heads, kv = model.n_heads // tp, max(1, model.kv_heads // tp)
    rows = round(tokens * model.experts_per_token * load) if model.moe else tokens
    shapes = {
        "q": (tokens, d, heads * hd),
        "kv": (tokens, d, 2 * kv * hd),
        "attn_out": (tokens, heads * hd, d),
        **({"router": (max(1, tokens // tp), d, model.n_experts)} if model.moe else {}),
        "mlp_in": (rows, d, (2 if model.family == "llama" else 1) * f // tp),
        "mlp_out": (rows, f // tp, d),
    }
    return shapes


def block_linears(model: ModelConfig, tokens: int, tp: int) -> dict[str, tuple[int, int, int]]:
    """Forward matmuls of one layer's linear layers on one tensor-parallel rank, one per `nn.Linear` as the model
    runs them (wq, wk, wv, wo and the MLP's w1, w3, w2), as (rows, inner, columns): what FP8 training converts, and
    the shapes preflight times a `Float8Linear` at. Their FLOPs add up to `layer_matmuls`'."""
    d, hd, f = model.dim, model.head_dim, model.ffn_dim // tp
    heads, kv = model.n_heads // tp, max(1, model.kv_heads // tp)
    mlp = {"w1": (tokens, d, f), "w3": (tokens, d, f)} if model.family == "llama" else {"w1": (tokens, d, f)}
    return {
        "wq": (tokens, d, heads * hd),
        "wk": (tokens, d, kv * hd),
        "wv": (tokens, d, kv * hd),
        "wo": (tokens, heads * hd, d),
        **mlp,
        "w2": (tokens, f, d),
    }


def output_matmul(model: ModelConfig, tokens: int, tp: int) -> tuple[int, int, int]:
    return tokens, model.dim, model.vocab_size // tp


def matmul_flops(shape: tuple[int, int, int]) -> float:
    m, k, n = shape
    return 2.0 * m * k * n


def attention_flops(model: ModelConfig, micro_batch: int, seq_len: int, tp: int, cp: int = 1) -> float:
    """Nominal forward + backward FLOPs of one layer's attention core on one rank (QK^T and AV, causal mask ignored,
    as in `ModelConfig.flops_per_token`): under context parallelism its 1/cp of the queries against every key (its
    load-balanced chunks do 1/cp of the causal work too)."""
    return 12.0 * micro_batch * seq_len * seq_len * model.dim / tp / cp


def memory_op_bytes(
    model: ModelConfig, tokens: int, tp: int, sp: bool, act_bytes: int, load: float = 1.0
) -> dict[str, float]:
    """Nominal bytes moved, forward + backward, by one layer's memory-bound operations on one rank: elements read
    and written, counted once each (norm: 2 + 3 passes over its input; SwiGLU's silu(a) * b: 3 + 5 over an
    f-wide tensor, GeLU 2 + 3; rotary on q and k: 2 + 2; two residual adds: 3 + 3 each). A mixture of experts
    runs its SwiGLUs on the choices its experts take (`layer_matmuls`), and moves each choice's token and output
    about 6 times more (grouping, weighting, forward and backward), counted with them."""
    d, f = model.dim, model.ffn_dim // tp
    outside = tokens * d / (tp if sp else 1)  # norms and residuals run on a sequence shard under SP
    rotated = tokens * (model.n_heads + model.kv_heads) * model.head_dim / tp
    act_passes = 8 if model.family == "llama" else 5
    routed = tokens * model.experts_per_token * load * (act_passes * f + 6 * d) if model.moe else 0.0
    return {
        "norm": 2 * 5 * outside * act_bytes,
        "activation": (routed or act_passes * tokens * f) * act_bytes,
        "rotary": 4 * rotated * act_bytes,
        "residual": 2 * 6 * outside * act_bytes,
    }


def loss_bytes(model: ModelConfig, tokens: int, tp: int) -> float:
    """Cross-entropy over the logits, forward + backward, in fp32: read and written twice each."""
    return 4.0 * tokens * model.vocab_size / tp * 4


def optimizer_bytes(params: float, weight_bytes: int, grad_bytes: int, optimizer_bytes: int) -> float:
    """AdamW reads weights, gradients and states and writes weights and states."""
    return params * (2 * weight_bytes + grad_bytes + 2 * optimizer_bytes)


def block_shape(
    model: ModelConfig,
    seq_len: int,
    micro_batch: int,
    precision: str,
    tp: int,
    sp: bool,
    recompute: str,
    compiled: bool = False,
    fp8: str = "none",
    cp: int = 1,
) -> str:
    """What a whole-block measurement depends on, as one string: the model's shape, the tensor-parallel degree
    (and sequence parallelism), the recomputation mode, the micro-batch, the sequence (and its split over cp
    ranks), the precision mode (and its FP8 recipe, `precision.fp8`) and whether the block was compiled
    (`parallel.compile`). Preflight records a block's time under this key and the planner uses it only for a
    workload with the same key."""
    m = model
    experts = f" experts{m.n_experts}/{m.experts_per_token}" if m.moe else ""
    return (
        f"{m.family} dim{m.dim} layers{m.n_layers} heads{m.n_heads}/{m.kv_heads} ffn{m.ffn_dim}{experts} "
        f"vocab{m.vocab_size} rotary{m.rotary_pct:g} tied{int(m.tie_embeddings)} docmask{int(m.doc_mask)} "
        f"parallel_residual{int(m.parallel_residual and m.family == 'neox')} | tp{tp} sp{int(sp and tp > 1)} "
        f"ac:{recompute} mb{micro_batch} seq{seq_len}{f' cp{cp}' if cp > 1 else ''} {precision}"
        f"{f' fp8:{fp8}' if fp8 != 'none' else ''}{' compiled' if compiled else ''}"
    )


def dp_block_shape(shape: str, sharding: str, dp: int, accumulate: bool) -> str:
    """The key of a block timed under data parallelism: `shape` (`block_shape`) with the arrangement
    (`Layout.sharding`: fsdp, zero1 or ddp) over `dp` ranks, as a step's last micro-batch runs it (gradients
    reduced) or, `accumulate`, as its others do (gradients accumulated without a reduction)."""
    return f"{shape} | dp{dp} {sharding}{' accumulate' if accumulate else ''}"


def interpolate(table: list[list[float]], x: float) -> float:
    """The y of sorted [x, y] rows at x, linear in log x between rows and flat beyond the ends."""
    xs = [row[0] for row in table]
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return table[0][1]
    if i == len(table):
        return table[-1][1]
    (x0, y0), (x1, y1) = table[i - 1][:2], table[i][:2]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + w * (y1 - y0)
