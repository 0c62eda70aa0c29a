"""Pure-bf16 training: stochastic rounding and an AdamW whose weights, gradients and moments all live in bf16.

The update itself is computed in fp32, one parameter at a time, and only the write-back rounds. Rounding to
nearest loses every update smaller than half a bf16 spacing (2^-9 relative: a weight of 1.0 ignores steps
below 0.002); stochastic rounding keeps them in expectation, Kahan summation carries them in a buffer.
"""

from __future__ import annotations

import functools
import hashlib
import math

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from hlat.dtensor import local

ROUNDINGS = ("stochastic", "kahan", "nearest")
_KEEP_BF16_BITS = -65536  # 0xFFFF0000 as int32: sign, exponent and the 7 mantissa bits bf16 keeps


_MASK32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) of int64 values below 2^32: neighbouring inputs give
    independent-looking outputs. Plain integer arithmetic, so a compiled update fuses it into one kernel."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def rounding_noise(like: Tensor, key_lo: int, key_hi: int, stream: int = 0) -> Tensor:
    """Uniform int32 in [0, 2^16), one per element of `like`: a pure function of (key, stream, element index),
    so the same 64-bit key (two 32-bit halves) gives the same bits on any device or process (a counter-based
    generator, with no generator state to carry)."""
    counter = torch.arange(like.numel(), dtype=torch.int64, device=like.device) * 3 + stream
    x = _mix32((counter & _MASK32) ^ key_lo)
    x = _mix32(x ^ key_hi ^ (counter >> 32))
    return (x >> 16).to(torch.int32).view(like.shape)


def stochastic_round(x: Tensor, key: int, stream: int = 0) -> Tensor:
    """`x` rounded to bf16 so that E[result] == x: to one of its two bf16 neighbours, away from zero with
    probability equal to x's fractional position between them. The 64-bit `key` (and `stream`, for several
    roundings under one key) picks the random bits.

    bf16 is fp32 without the low 16 mantissa bits, and fp32's bit pattern, read as an integer, grows linearly with
    the magnitude inside each binade (subnormals included) and carries into the exponent at the binade's end. So
    adding uniform noise in [0, 2^16) to those bits and truncating them rounds the magnitude up with exactly that
    probability. ±inf stays ±inf; arithmetic's NaNs (quiet bit set) stay NaN."""
    return _stochastic_round(x, key & _MASK32, key >> 32, stream)


def _stochastic_round(x: Tensor, key_lo: int, key_hi: int, stream: int) -> Tensor:
    x = x.float()
    noise = rounding_noise(x, key_lo, key_hi, stream)
    return (x.view(torch.int32) + noise).bitwise_and_(_KEEP_BF16_BITS).view(torch.float32).to(torch.bfloat16)


def rounding_seed(seed: int, step: int, index: int, shard: tuple[int, ...] = ()) -> int:
    """The 64-bit rounding key of one parameter at one step. Stable across processes and Python versions
    (unlike hash()), so a resumed run and every data-parallel replica draw the same bits."""
    key = ",".join(map(str, (seed, step, index, *shard))).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def _like_param(grad: Tensor, p: Tensor) -> Tensor:
    """The gradient laid out as its parameter, element for element: under tensor parallelism DTensor may hand a
    sharded parameter a replicated gradient (the vocabulary-parallel embedding's), which this rank then cuts to
    its own shard."""
    if isinstance(grad, DTensor) and grad.placements != p.placements:
        return grad.redistribute(p.device_mesh, p.placements)
    return grad


def _shard(p: Tensor) -> tuple[int, ...]:
    """Which shard of `p` this rank holds: its mesh coordinates along the sharded mesh dimensions. Replicas (the
    replicated dimensions) share it and so draw identical bits; different shards draw independent ones."""
    if not isinstance(p, DTensor):
        return ()
    coordinate = p.device_mesh.get_coordinate() or []
    return tuple(c for c, placement in zip(coordinate, p.placements) if placement.is_shard())


class BF16AdamW(torch.optim.Optimizer):
    """AdamW (torch.optim.AdamW's decoupled weight decay and bias correction) over bf16 parameters, with bf16
    first and second moments.

    Each parameter's update runs in fp32 and is written back with `rounding`:
      - "stochastic": weights and moments rounded stochastically (bf16_sr);
      - "kahan": weights rounded to nearest plus a bf16 compensation buffer holding what the rounding lost,
        added back on the next step (bf16_kahan); moments rounded stochastically;
      - "nearest": everything rounded to nearest, the plain-bf16 baseline that stalls on small updates.
    The moments are rounded stochastically too because round-to-nearest freezes them: with beta2 = 0.999, the
    decay v * beta2 is within half a bf16 spacing of v, so a stored v could never shrink.

    Parameters are updated one at a time rather than with foreach kernels over all of them: foreach would hold
    fp32 copies of every weight, gradient and moment at once (16 bytes per parameter), more than pure bf16 saves.

    Random bits are a counter-based function of (group seed, step, parameter index, shard), never the global
    RNG: replicas holding the same values make the same rounding decisions, and the seed and per-parameter step
    are in the state dict, so a resumed run rounds exactly as the uninterrupted one would.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, *, rounding: str = "stochastic", seed: int = 0):
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, seed=seed))
        self.rounding = rounding
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    raise ValueError(f"BF16AdamW needs bf16 parameters, got {p.dtype} {tuple(p.shape)} "
                                     "(cast the model with hlat.optim.precision.prepare_model first)")

    def _init_state(self, p: Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)  # a float CPU tensor, like torch.optim.AdamW's
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if self.rounding == "kahan":
                state["compensation"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            updates = []
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self._init_state(p)
                state["step"] += 1
                step = int(state["step"])
                updates.append((p, state, rounding_seed(group["seed"], step, index, _shard(p)),
                                (lr / (1 - beta1**step), math.sqrt(1 - beta2**step))))
            if not updates:
                continue
            device = local(updates[0][0]).device
            scalars = {"one_minus_beta1": 1 - beta1, "beta2": beta2, "one_minus_beta2": 1 - beta2, "eps": eps,
                       "decay": 1 - lr * wd}
            compiled = device.type in COMPILED_UPDATE_DEVICES
            if compiled:  # tensors, so a new lr or step is an input of the compiled kernel rather than a recompile
                keys = torch.tensor([[key & _MASK32, key >> 32] for _, _, key, _ in updates], device=device)
                corrections = torch.tensor([c for *_, c in updates], dtype=torch.float32, device=device)
                scalars = dict(zip(scalars, torch.tensor(list(scalars.values()), dtype=torch.float32, device=device)))
            update = _compiled_update() if compiled else adamw_update
            for i, (p, state, key, (step_size, bias_correction2_sqrt)) in enumerate(updates):
                if compiled:
                    (key_lo, key_hi), (step_size, bias_correction2_sqrt) = keys[i], corrections[i]
                else:
                    key_lo, key_hi = key & _MASK32, key >> 32
                compensation = state.get("compensation")
                grad = _like_param(p.grad, p)
                tensors = [local(t).view(-1) for t in (p, grad, state["exp_avg"], state["exp_avg_sq"])]
                update(*tensors, None if compensation is None else local(compensation).view(-1),
                       **scalars, neg_step_size=-step_size, bias_correction2_sqrt=bias_correction2_sqrt,
                       key_lo=key_lo, key_hi=key_hi, rounding=self.rounding)
        return loss


# Devices where the update runs compiled: one fused kernel per parameter (read 8 bytes, write 6 or 8 per element)
# instead of ~20 passes over fp32 temporaries: by a count of the bytes, ~1 TB per llama2-7b step, ~0.4 s at an
# H100's bandwidth (estimated, not timed). Elsewhere (the CPU, where tests run) it runs eagerly. Both do the same
# fp32 arithmetic and draw the same bits; the scalars are Python numbers eagerly and 0-d tensors compiled, which
# the operations below treat alike.
COMPILED_UPDATE_DEVICES = ("cuda",)


def adamw_update(weight: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, compensation: Tensor | None, *,
                 one_minus_beta1, beta2, one_minus_beta2, eps, decay, neg_step_size, bias_correction2_sqrt,
                 key_lo, key_hi, rounding: str) -> None:
    """One AdamW step of one bf16 tensor, in place: torch.optim.AdamW's single-tensor arithmetic in fp32 (the
    same operations, so the same bits), then written back with `rounding` (see BF16AdamW)."""
    g = grad.float()
    m = exp_avg.float().lerp_(g, one_minus_beta1)
    v = exp_avg_sq.float().mul_(beta2).addcmul_(g * one_minus_beta2, g)
    denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    w = weight.float().mul_(decay).addcdiv_(m * neg_step_size, denom)
    if rounding == "kahan":
        w = w + compensation.float()
        weight.copy_(w)
        compensation.copy_(w - weight.float())  # what rounding w to bf16 lost (exact in fp32)
    elif rounding == "stochastic":
        weight.copy_(_stochastic_round(w, key_lo, key_hi, 0))
    else:
        weight.copy_(w)
    if rounding != "nearest":
        m, v = _stochastic_round(m, key_lo, key_hi, 1), _stochastic_round(v, key_lo, key_hi, 2)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)


@functools.cache
def _compiled_update():
    # dynamic: one kernel for every parameter size. emulate_precision_casts: inductor otherwise folds the bf16
    # round trip in kahan's `w - weight.float()` into `w - w`, and the compensation would always be 0.
    return torch.compile(adamw_update, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True})
