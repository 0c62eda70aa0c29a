"""FP8 matmul rates as the trainer runs them: a torchao `Float8Linear` (what torchao's float8 training puts in
place of each linear layer of a block) at every shape of `hlat.planner.costs.block_linears`, forward + backward
with its casts and scaling, for each scaling recipe of `precision.fp8`; the profile keeps one table per recipe
(`Measured.matmul_fp8_<recipe>`), which the planner prices FP8 from.

Only a device with FP8 tensor cores (CUDA compute capability 8.9 or above) with torchao installed is measured.
Elsewhere nothing is, and the report says why in one line: torchao's emulation (`emulate=True`, which a CPU runs)
computes the same numbers at no hardware's speed. The tests time the emulated module through the same path."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from hlat.measure.options import Options
from hlat.measure.report import ComputeRow
from hlat.measure.timing import timed
from hlat.optim.fp8 import float8_config, load_torchao
from hlat.optim.fp8 import fp8_unsupported as fp8_device_unsupported
from hlat.optim.precision import autocast, dtypes
from hlat.planner.costs import block_linears, matmul_flops


def fp8_unsupported(device: torch.device) -> str:
    """Why FP8 matmuls cannot be measured on `device` ('' when they can)."""
    why = fp8_device_unsupported(device)
    if not why and importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install 'hlat[fp8]')"
    return why


def measure_fp8(options: Options, device: torch.device) -> tuple[str, list[ComputeRow], dict]:
    """The report's line on FP8, the rows timed, and the `Measured` tables they give (none where the device has
    no FP8 tensor cores)."""
    if not options.fp8:
        return "FP8 matmuls: not measured (--fp8 none)", [], {}
    why = fp8_unsupported(device)
    if why:
        return f"FP8 matmuls: not measured: {why}; emulation is no hardware figure", [], {}
    rows, fields = [], {}
    for recipe in options.fp8:
        make_linear = partial(
            float8_linear, recipe=recipe, device=device, dtype=dtypes(fp8_mode(options))[0], compiled=True
        )
        recipe_rows, fields[f"matmul_fp8_{recipe}"] = linear_rates(options, device, make_linear, f"fp8 {recipe}")
        rows += recipe_rows
    return f"FP8 matmuls: measured ({', '.join(options.fp8)})", rows, fields


def float8_linear(
    in_features: int,
    out_features: int,
    recipe: str,
    device: torch.device,
    dtype: torch.dtype,
    emulate: bool = False,
    compiled: bool = False,
) -> nn.Module:
    """A block's linear layer (no bias) as hlat's FP8 training converts it (torchao's `convert_to_float8_training`
    with hlat's `float8_config`); `emulate` computes in high precision what the FP8 kernels would (a CPU's only
    way). `compiled`: as the trainer runs it with parallel.compile, its casts and scaling fused (eager, each cast
    and amax is a kernel of its own: on an H100 that ran the 1B setting's linears at 109-189 TFLOP/s, against
    bf16's 684-766, while compiled FP8 made the whole step 1.12x faster than bf16's, benchmarks/results)."""
    float8 = load_torchao()
    linear = nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
    linear = float8.convert_to_float8_training(linear, config=float8_config(recipe, emulate))  # a root linear
    return torch.compile(linear) if compiled else linear


def linear_rates(
    options: Options, device: torch.device, make_linear: Callable[[int, int], nn.Module], label: str
) -> tuple[list[ComputeRow], list[list[float]]]:
    """Forward + backward of `make_linear(in_features, out_features)` at each distinct shape of a block's linear
    layers (per micro-batch and tensor-parallel degree), under `fp8_mode`'s autocast; the rates as [forward FLOPs
    per call, TFLOP/s] sorted by FLOPs. One rate per FLOP count: the 3 x forward FLOPs over the seconds of every
    linear layer that runs it (a Llama MLP's w1, w3 and w2 share one), so that a block measured is priced at
    exactly its linears' measured time."""
    rows, totals, mode = [], {}, fp8_mode(options)  # FLOPs per call -> [FLOPs run, seconds] of the linears
    for shape, names in block_linear_shapes(options).items():
        tokens, inner, columns = shape
        linear = make_linear(inner, columns)
        x = torch.randn(tokens, inner, device=device, dtype=dtypes(mode)[1], requires_grad=True)
        seconds = timed(partial(linear_step, linear, x, mode), device, options.repeats)
        flops = matmul_flops(shape)
        total = totals.setdefault(flops, [0.0, 0.0])
        total[0], total[1] = total[0] + 3 * flops * len(names), total[1] + seconds * len(names)
        rows.append(
            ComputeRow(
                f"linear {'/'.join(names)} {label} (fwd+bwd)",
                f"{tokens}x{inner}x{columns}",
                seconds,
                f"{3 * flops / seconds / 1e12:.3g} TFLOP/s",
            )
        )
    return rows, sorted([flops, run / seconds / 1e12] for flops, (run, seconds) in totals.items())


def fp8_mode(options: Options) -> str:
    """The precision mode FP8 linears are timed in: the config's, or pure bf16 (bf16 weights and inputs) where it
    is fp32, which FP8 never runs over."""
    return "bf16_sr" if options.precision == "fp32" else options.precision


def block_linear_shapes(options: Options) -> dict[tuple[int, int, int], list[str]]:
    """Each distinct (rows, inner, columns) of `block_linears` over the micro-batches and tensor-parallel degrees,
    with the linear layers that run it (['wq tp1', 'wo tp1'])."""
    linears: dict[tuple[int, int, int], list[str]] = {}
    for micro_batch in options.micro_batches():
        for tp in options.tps:
            for name, shape in block_linears(options.model, options.seq_len * micro_batch, tp).items():
                linears.setdefault(shape, []).append(f"{name} tp{tp}")
    return linears


def linear_step(linear: nn.Module, x: torch.Tensor, precision: str) -> None:
    """One forward + backward into fresh gradients (nothing accumulated: a step's first micro-batch)."""
    linear.weight.grad = x.grad = None
    with autocast(precision, x.device):
        y = linear(x)
    y.backward(torch.ones_like(y))
