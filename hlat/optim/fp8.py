"""FP8 training of the transformer blocks' linear layers through torchao's float8 training (`precision.fp8`,
docs/precision.md).

Each block's attention and MLP projections become torchao `Float8Linear`s: their inputs, weights and output
gradients are scaled and cast to float8 (e4m3 forward, e5m2 for gradients) around each matmul, with one scale per
tensor (`tensorwise`) or per row (`rowwise`). The parameters stay what the precision mode stores (fp32 master
weights in bf16_mixed, bf16 in the pure-bf16 modes) under their own names, so checkpoints hold plain weights and
move between FP8 and bf16 runs both ways. The embeddings, the norms and the output projection stay in bf16.

On a CPU, torchao emulates the FP8 matmuls (the same casts and scales, a high-precision matmul): the numerics of
FP8 without its speed, so every layout can be tested anywhere. On CUDA it needs FP8 tensor cores (compute
capability 8.9: Ada, Hopper and newer)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging

import torch
from torch import nn

from hlat import HlatError
from hlat.torch_private import emulate_precision_casts

FP8_CAPABILITY = (8, 9)


def fp8_support(recipe: str, device: torch.device) -> str:
    """How `precision.fp8 = recipe` runs on `device`: "native" or "emulated" (a CPU); anything else is refused in
    one line naming the device. Checked before any process group starts."""
    if recipe == "none":
        return "native"
    load_torchao()
    if device.type == "cpu":
        return "emulated"
    why = fp8_unsupported(device)
    if why:
        raise HlatError(f'precision.fp8: {why}; set precision.fp8 = "none"')
    return "native"


def fp8_unsupported(device: torch.device) -> str:
    """Why `device` cannot run FP8 matmuls natively ("" when it can): FP8 tensor cores are CUDA compute capability
    8.9 and newer (Ada, Hopper, Blackwell); a CPU only emulates them."""
    if device.type != "cuda":
        return f"{device.type} has no FP8 tensor cores (torchao's float8 training runs on CUDA GPUs, emulated on a CPU)"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        return (
            f"{torch.cuda.get_device_name(device)} (compute capability {capability[0]}.{capability[1]}) has no "
            "FP8 tensor cores (8.9 or newer: Ada, Hopper, Blackwell)"
        )
    return ""


def load_torchao():
    """torchao's float8 package, imported quietly (it logs every optional kernel library it cannot load, and
    none of those is used here); a missing torchao is one line."""
    try:
        with contextlib.redirect_stderr(io.StringIO()), quiet_loggers("torchao", "torch.utils._pytree"):
            import torchao.float8
    except ImportError:
        raise HlatError("precision.fp8: needs torchao: pip install 'hlat[fp8]'") from None
    return torchao.float8


@contextlib.contextmanager
def quiet_loggers(*names: str):
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def is_block_linear(module: nn.Module, fqn: str) -> bool:
    """The linear layers FP8 converts: those inside the transformer blocks whose dimensions FP8 matmuls accept
    (multiples of 16); the output projection and anything outside the blocks stay as they are."""
    return (
        isinstance(module, nn.Linear)
        and fqn.startswith("layers.")
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def convert_blocks(model: nn.Module, recipe: str, emulate: bool, fsdp_fp8_all_gather: bool) -> None:
    """Swap the blocks' linear layers of a (meta) model for torchao Float8Linears, in place, before any parallel
    wrapping. `fsdp_fp8_all_gather` (tensorwise under FSDP): the sharded weights are cast to FP8 before they are
    all-gathered, half the bytes of bf16, with one scale per weight computed over all its shards."""
    load_torchao().convert_to_float8_training(
        model, config=float8_config(recipe, emulate, fsdp_fp8_all_gather), module_filter_fn=is_block_linear
    )


def float8_config(recipe: str, emulate: bool, fsdp_fp8_all_gather: bool = False):
    """torchao's Float8LinearConfig of `recipe`, as hlat trains with it (and preflight times it)."""
    if recipe == "rowwise":  # compiled rowwise casts must round as eager ones do (pytorch/pytorch#150859)
        emulate_precision_casts()
    return dataclasses.replace(
        load_torchao().Float8LinearConfig.from_recipe_name(recipe),
        emulate=emulate,
        enable_fsdp_float8_all_gather=fsdp_fp8_all_gather,
    )


def converted(model: nn.Module) -> int:
    """How many Float8Linears `model` holds."""
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


def precompute_scales_after_step(optimizer: torch.optim.Optimizer, part: nn.Module) -> None:
    """Under FSDP's FP8 all-gather, compute every weight's scale in one all-reduce after each update (instead of one
    small all-reduce per weight in the next forward)."""
    float8 = load_torchao()
    optimizer.register_step_post_hook(lambda *_: float8.precompute_float8_dynamic_scale_for_fsdp(part))
