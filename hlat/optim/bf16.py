"""Pure-bf16 training: stochastic rounding and an AdamW whose weights, gradients and moments all live in bf16.

The update itself is computed in fp32, one parameter at a time, and only the write-back rounds. Rounding to
nearest loses every update smaller than half a bf16 spacing (2^-9 relative: a weight of 1.0 ignores steps
below 0.002); stochastic rounding keeps them in expectation, Kahan summation carries them in a buffer.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

ROUNDINGS = ("stochastic", "kahan", "nearest")
_KEEP_BF16_BITS = -65536  # 0xFFFF0000 as int32: sign, exponent and the 7 mantissa bits bf16 keeps


def stochastic_round(x: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """`x` rounded to bf16 so that E[result] == x: to one of its two bf16 neighbours, away from zero with
    probability equal to x's fractional position between them.

    bf16 is fp32 without the low 16 mantissa bits, and fp32's bit pattern, read as an integer, grows linearly with
    the magnitude inside each binade (subnormals included) and carries into the exponent at the binade's end. So
    adding uniform noise in [0, 2^16) to those bits and truncating them rounds the magnitude up with exactly that
    probability. ±inf stays ±inf; arithmetic's NaNs (quiet bit set) stay NaN."""
    x = x.float()
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    return (x.view(torch.int32) + noise).bitwise_and_(_KEEP_BF16_BITS).view(torch.float32).to(torch.bfloat16)


def rounding_seed(seed: int, step: int, index: int, shard: tuple[int, ...] = ()) -> int:
    """A 64-bit generator seed for one parameter at one step. Stable across processes and Python versions
    (unlike hash()), so a resumed run and every data-parallel replica draw the same bits."""
    key = ",".join(map(str, (seed, step, index, *shard))).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


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

    Random bits come from a generator seeded by (group seed, step, parameter index, shard), never the global
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
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self._init_state(p)
                state["step"] += 1
                step = int(state["step"])
                generator = torch.Generator(device=_local(p).device)
                generator.manual_seed(rounding_seed(group["seed"], step, index, _shard(p)))

                weight, exp_avg, exp_avg_sq = _local(p), _local(state["exp_avg"]), _local(state["exp_avg_sq"])
                g = _local(p.grad).float()
                m = exp_avg.float().lerp_(g, 1 - beta1)
                v = exp_avg_sq.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
                w = weight.float().mul_(1 - lr * wd).addcdiv_(m, denom, value=-lr / (1 - beta1**step))

                if self.rounding == "kahan":
                    compensation = _local(state["compensation"])
                    w.add_(compensation.float())
                    weight.copy_(w)
                    compensation.copy_(w.sub_(weight.float()))  # what rounding w to bf16 lost (exact in fp32)
                elif self.rounding == "stochastic":
                    weight.copy_(stochastic_round(w, generator))
                else:
                    weight.copy_(w)
                if self.rounding != "nearest":
                    m, v = stochastic_round(m, generator), stochastic_round(v, generator)
                exp_avg.copy_(m)
                exp_avg_sq.copy_(v)
        return loss
