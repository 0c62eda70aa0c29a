"""Compute rates at the model's own shapes: every matmul of a layer and the output layer (per tensor-parallel
degree and micro-batch), causal attention (SDPA) at the sequence length, and the memory-bound operations (norm,
activation, rotary, residual, loss, a copy into a new buffer) as GB/s. Shapes, FLOPs and nominal bytes come from
`hlat.planner.costs`, so the planner prices exactly what was measured."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F

from hlat.measure.options import Options
from hlat.measure.report import ComputeRow
from hlat.measure.timing import timed
from hlat.models.layers import apply_rope, rope_table
from hlat.planner.costs import attention_flops, layer_matmuls, loss_bytes, matmul_flops, memory_op_bytes, output_matmul

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def measure_compute(options: Options, device: torch.device) -> tuple[list[ComputeRow], dict]:
    """Rows of what was timed, and the `Measured` fields they give."""
    rows, fields = [], {}
    for dtype_name in options.dtypes:
        matmul_rows, fields[f"matmul_{dtype_name}"] = measure_matmuls(options, device, dtype_name)
        attention_row, fields[f"attention_{dtype_name}"] = measure_attention(options, device, dtype_name)
        rows += [*matmul_rows, attention_row]
    memory_rows, bandwidths = measure_memory_bound(options, device)
    return rows + memory_rows, {**fields, **bandwidths}


def measure_matmuls(
    options: Options, device: torch.device, dtype_name: str
) -> tuple[list[ComputeRow], list[list[float]]]:
    """Every matmul of `matmul_shapes`; the rates as [FLOPs per call, TFLOP/s] sorted by FLOPs (one rate per FLOP
    count: the last shape timed with it)."""
    rows, tflops_at = [], {}
    for name, (lhs_rows, inner, rhs_cols) in matmul_shapes(options):
        lhs = torch.randn(lhs_rows, inner, device=device, dtype=DTYPES[dtype_name])
        rhs = torch.randn(inner, rhs_cols, device=device, dtype=DTYPES[dtype_name])
        seconds = timed(partial(torch.matmul, lhs, rhs), device, options.repeats)
        flops = matmul_flops((lhs_rows, inner, rhs_cols))
        tflops_at[flops] = flops / seconds / 1e12
        rows.append(
            ComputeRow(
                f"matmul {name} {dtype_name}",
                f"{lhs_rows}x{inner}x{rhs_cols}",
                seconds,
                f"{tflops_at[flops]:.3g} TFLOP/s",
            )
        )
    return rows, sorted([flops, tflops] for flops, tflops in tflops_at.items())


def matmul_shapes(options: Options) -> Iterator[tuple[str, tuple[int, int, int]]]:
    """(name, (rows, inner, columns)) of every matmul of a layer and of the output layer, for each micro-batch and
    tensor-parallel degree."""
    for micro_batch in options.micro_batches():
        tokens = options.seq_len * micro_batch
        for tp in options.tps:
            shapes = {**layer_matmuls(options.model, tokens, tp), "output": output_matmul(options.model, tokens, tp)}
            yield from ((f"{name} tp{tp}", shape) for name, shape in shapes.items())


def measure_attention(options: Options, device: torch.device, dtype_name: str) -> tuple[ComputeRow, list[list[float]]]:
    """Causal SDPA forward + backward at the micro-batch and sequence length, all heads on one device."""
    model = options.model
    shape = (options.micro_batch, model.n_heads, options.seq_len, model.head_dim)
    query = torch.randn(shape, device=device, dtype=DTYPES[dtype_name], requires_grad=True)
    key_value = torch.randn(shape, device=device, dtype=DTYPES[dtype_name], requires_grad=True)
    seconds = timed(
        lambda: backward(F.scaled_dot_product_attention(query, key_value, key_value, is_causal=True)),
        device,
        options.repeats,
    )
    tflops = attention_flops(model, options.micro_batch, options.seq_len, 1) / seconds / 1e12
    row = ComputeRow(
        f"attention (SDPA causal, fwd+bwd) {dtype_name}", "x".join(map(str, shape)), seconds, f"{tflops:.3g} TFLOP/s"
    )
    return row, [[options.seq_len, tflops]]


def backward(y: torch.Tensor) -> None:
    y.backward(torch.ones_like(y))


def measure_memory_bound(options: Options, device: torch.device) -> tuple[list[ComputeRow], dict]:
    """GB/s of each memory-bound operation, fwd + bwd, at one layer's shapes (in the compute dtype of the first
    --dtype), against the nominal bytes of `hlat.planner.costs`; then the loss and a copy."""
    dtype = DTYPES[options.dtypes[0]]
    tokens = options.seq_len * options.micro_batch
    nominal = memory_op_bytes(options.model, tokens, 1, False, dtype.itemsize)
    rows, bandwidths = [], {}
    for op, fn in memory_bound_ops(options, device, dtype).items():
        seconds = timed(fn, device, options.repeats)
        bandwidths[f"{op}_gbs"] = nominal[op] / seconds / 1e9
        rows.append(ComputeRow(f"{op} (fwd+bwd)", f"{tokens} tokens", seconds, f"{bandwidths[f'{op}_gbs']:.3g} GB/s"))
    loss_row, bandwidths["loss_gbs"] = measure_loss(options, device)
    copy_row, bandwidths["copy_gbs"] = measure_copy(options, device)
    return [*rows, loss_row, copy_row], bandwidths


def memory_bound_ops(options: Options, device: torch.device, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """Each operation forward + backward over one layer's activations, as many times as a layer runs it."""
    model, shape = options.model, (options.micro_batch, options.seq_len)
    x = torch.randn(*shape, model.dim, device=device, dtype=dtype, requires_grad=True)
    gate = torch.randn(*shape, model.ffn_dim, device=device, dtype=dtype, requires_grad=True)
    up = torch.randn_like(gate, requires_grad=True)
    qk = torch.randn(
        *shape, model.n_heads + model.kv_heads, model.head_dim, device=device, dtype=dtype, requires_grad=True
    )
    rope = rope_table(model, device)[: options.seq_len]
    weight = torch.ones(model.dim, device=device, dtype=dtype)
    return {
        "norm": lambda: [backward(F.rms_norm(x, (model.dim,), weight)) for _ in range(2)],
        "activation": lambda: backward(F.silu(gate) * up if model.family == "llama" else F.gelu(gate)),
        "rotary": lambda: backward(apply_rope(qk, rope)),
        "residual": lambda: [backward(x + x) for _ in range(2)],
    }


def measure_loss(options: Options, device: torch.device) -> tuple[ComputeRow, float]:
    """Cross-entropy forward + backward over the micro-batch's logits (fp32)."""
    model, tokens = options.model, options.seq_len * options.micro_batch
    logits = torch.randn(tokens, model.vocab_size, device=device, requires_grad=True)
    targets = torch.randint(model.vocab_size, (tokens,), device=device)
    seconds = timed(lambda: F.cross_entropy(logits, targets).backward(), device, options.repeats)
    gbs = loss_bytes(model, tokens, 1) / seconds / 1e9
    return ComputeRow("loss (cross-entropy, fwd+bwd)", f"{tokens}x{model.vocab_size}", seconds, f"{gbs:.3g} GB/s"), gbs


def measure_copy(options: Options, device: torch.device) -> tuple[ComputeRow, float]:
    """A layer's parameters (fp32) copied into a freshly allocated buffer, as `fully_shard`'s gathers and
    reductions copy a unit into (or out of) a flat one."""
    params = options.model.layer_params()
    unit = torch.randn(params, device=device)
    seconds = timed(lambda: torch.empty_like(unit).copy_(unit), device, options.repeats)
    gbs = 2 * 4 * params / seconds / 1e9
    return ComputeRow("copy into a new buffer (fully_shard)", f"{params} fp32", seconds, f"{gbs:.3g} GB/s"), gbs
