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
MAX_NUMEL = 2**31 - 1  # elements a tensor's random bits are drawn for: each element's index is an int32


def _int32(value: int) -> int:
    """A 32-bit pattern (0 <= value < 2^32) as the int32 holding it: the random bits are int32 arithmetic."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _shift_right(x: Tensor, k: int) -> Tensor:
    """x >>> k for int32: torch's >> is arithmetic (it copies the sign bit), so the sign's copies are masked off."""
    return (x >> k) & ((1 << (32 - k)) - 1)


def _mix32(x: Tensor) -> Tensor:
    """Wellons' lowbias32, a 32-bit integer hash (neighbouring inputs give independent-looking outputs), on int32:
    a multiply wraps mod 2^32 like an unsigned one and the shifts are logical, so the bits are those of the uint32
    hash. Plain 32-bit integer arithmetic, which a compiled update fuses into its kernel at a few instructions per
    operation (int64, as this once was, costs several per multiply on a GPU)."""
    x = x ^ _shift_right(x, 16)
    x = x * 0x7FEB352D
    x = x ^ _shift_right(x, 15)
    x = x * _int32(0x846CA68B)
    return x ^ _shift_right(x, 16)


_SECOND_WORD = _int32(0x9E3779B9)  # sets the second hash of an element apart from the first (2^32 / golden ratio)


def rounding_noises(numel: int, device, key_lo, key_hi) -> tuple[Tensor, Tensor, Tensor]:
    """Three streams of uniform int32 in [0, 2^16), `numel` each (the update's weight, exp_avg and exp_avg_sq):
    a pure function of (key, stream, element index), so the same 64-bit key (two 32-bit halves, as int32) gives
    the same bits on any device or process, eager or compiled (a counter-based generator, with no state to carry).

    Each element's index is hashed with the key's low half, that with the high half (two rounds, as the key has
    64 bits), and the result once more under a constant for a second 32-bit word: streams 0 and 1 are the first
    word's halves, stream 2 the second's high half. Three hashes per element for three streams, where one
    two-round hash per stream would take six. Indices are int32, so a tensor has at most MAX_NUMEL elements:
    beyond that they would repeat, and this raises instead."""
    if numel > MAX_NUMEL:
        raise ValueError(f"stochastic rounding draws bits for at most {MAX_NUMEL} elements per tensor, got {numel}")
    element = _mix32(torch.arange(numel, dtype=torch.int32, device=device) ^ key_lo)
    first, second = _mix32(element ^ key_hi), _mix32(element ^ key_hi ^ _SECOND_WORD)
    return _shift_right(first, 16), first & 0xFFFF, _shift_right(second, 16)


def rounding_noise(like: Tensor, key_lo: int, key_hi: int, stream: int = 0) -> Tensor:
    """Stream `stream` (0, 1 or 2) of `rounding_noises`, shaped like `like`; the key halves as unsigned 32-bit
    numbers."""
    return rounding_noises(like.numel(), like.device, _int32(key_lo), _int32(key_hi))[stream].view(like.shape)


def stochastic_round(x: Tensor, key: int, stream: int = 0) -> Tensor:
    """`x` rounded to bf16 so that E[result] == x: to one of its two bf16 neighbours, away from zero with
    probability equal to x's fractional position between them. The 64-bit `key` (and `stream`, 0 to 2, for
    several roundings under one key) picks the random bits.

    bf16 is fp32 without the low 16 mantissa bits, and fp32's bit pattern, read as an integer, grows linearly with
    the magnitude inside each binade (subnormals included) and carries into the exponent at the binade's end. So
    adding uniform noise in [0, 2^16) to those bits and truncating them rounds the magnitude up with exactly that
    probability. ±inf stays ±inf; arithmetic's NaNs (quiet bit set) stay NaN."""
    return _stochastic_round(x, rounding_noise(x, key & _MASK32, key >> 32, stream))


def _stochastic_round(x: Tensor, noise: Tensor) -> Tensor:
    x = x.float()
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

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        rounding: str = "stochastic",
        seed: int = 0,
    ):
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, seed=seed))
        self.rounding = rounding
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    raise ValueError(
                        f"BF16AdamW needs bf16 parameters, got {p.dtype} {tuple(p.shape)} "
                        "(cast the model with hlat.optim.precision.prepare_model first)"
                    )
                if local(p).numel() > MAX_NUMEL:  # each rank rounds its own shard, indexed in int32
                    raise ValueError(
                        f"BF16AdamW rounds tensors of at most {MAX_NUMEL} elements a rank, got {tuple(local(p).shape)}"
                    )

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
    def step(self, closure=None, *, grad_scale: Tensor | float | None = None):
        """One update of every parameter with a gradient. `grad_scale` multiplies every gradient as the update
        reads it (in fp32): gradient clipping's coefficient (hlat.parallel.grads.clip_coefficient) applied without
        a pass of its own over the gradients, and without rounding the scaled gradient to bf16. A 0-d tensor stays
        on the device (the compiled update takes it as an input: no host read, no recompile); None is 1."""
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
                key = rounding_seed(group["seed"], step, index, _shard(p))
                updates.append(
                    (
                        p,
                        state,
                        (_int32(key & _MASK32), _int32(key >> 32)),
                        (lr / (1 - beta1**step), math.sqrt(1 - beta2**step)),
                    )
                )
            if updates:
                self._update(
                    updates,
                    grad_scale,
                    {
                        "one_minus_beta1": 1 - beta1,
                        "beta2": beta2,
                        "one_minus_beta2": 1 - beta2,
                        "eps": eps,
                        "decay": 1 - lr * wd,
                    },
                )
        return loss

    def _update(self, updates: list, grad_scale, scalars: dict) -> None:
        """One group's updates, each (parameter, state, int32 key halves, (step size, sqrt of bias correction 2))."""
        device = local(updates[0][0]).device
        compiled = device.type in COMPILED_UPDATE_DEVICES
        if compiled:  # tensors, so a new lr, step or scale is an input of the compiled kernel rather than a recompile
            keys = torch.tensor([key for _, _, key, _ in updates], dtype=torch.int32, device=device)
            corrections = torch.tensor([c for *_, c in updates], dtype=torch.float32, device=device)
            scalars = dict(zip(scalars, torch.tensor(list(scalars.values()), dtype=torch.float32, device=device)))
            grad_scale = torch.as_tensor(1.0 if grad_scale is None else grad_scale, dtype=torch.float32, device=device)
        update = _compiled_update() if compiled else adamw_update
        for i, (p, state, (key_lo, key_hi), (step_size, bias_correction2_sqrt)) in enumerate(updates):
            if compiled:
                (key_lo, key_hi), (step_size, bias_correction2_sqrt) = keys[i], corrections[i]
            compensation = state.get("compensation")
            grad = _like_param(p.grad, p)
            tensors = [local(t).view(-1) for t in (p, grad, state["exp_avg"], state["exp_avg_sq"])]
            update(
                *tensors,
                None if compensation is None else local(compensation).view(-1),
                grad_scale=grad_scale,
                **scalars,
                neg_step_size=-step_size,
                bias_correction2_sqrt=bias_correction2_sqrt,
                key_lo=key_lo,
                key_hi=key_hi,
                rounding=self.rounding,
            )


# Devices where the update runs compiled: one fused kernel per parameter (read 8 bytes, write 6 or 8 per element)
# instead of ~20 passes over fp32 temporaries: by a count of the bytes, ~1 TB per llama2-7b step, ~0.4 s at an
# H100's bandwidth (estimated, not timed). Elsewhere (the CPU, where tests run) it runs eagerly. Both do the same
# fp32 arithmetic and draw the same bits; the scalars are Python numbers eagerly and 0-d tensors compiled, which
# the operations below treat alike.
COMPILED_UPDATE_DEVICES = ("cuda",)


def adamw_update(
    weight: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    compensation: Tensor | None,
    *,
    grad_scale,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    decay,
    neg_step_size,
    bias_correction2_sqrt,
    key_lo,
    key_hi,
    rounding: str,
) -> None:
    """One AdamW step of one bf16 tensor, in place: torch.optim.AdamW's single-tensor arithmetic in fp32 (the
    same operations, so the same bits) on the gradient times `grad_scale` (None: 1), then written back with
    `rounding` (see BF16AdamW). The key halves are int32."""
    g = grad.float() if grad_scale is None else grad.float() * grad_scale
    m = exp_avg.float().lerp_(g, one_minus_beta1)
    v = exp_avg_sq.float().mul_(beta2).addcmul_(g * one_minus_beta2, g)
    denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    w = weight.float().mul_(decay).addcdiv_(m * neg_step_size, denom)
    if rounding != "nearest":
        noise_w, noise_m, noise_v = rounding_noises(weight.numel(), weight.device, key_lo, key_hi)
    if rounding == "kahan":
        w = w + compensation.float()
        weight.copy_(w)
        compensation.copy_(w - weight.float())  # what rounding w to bf16 lost (exact in fp32)
    elif rounding == "stochastic":
        weight.copy_(_stochastic_round(w, noise_w))
    else:
        weight.copy_(w)
    if rounding != "nearest":
        m, v = _stochastic_round(m, noise_m), _stochastic_round(v, noise_v)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)


@functools.cache
def _compiled_update():
    # dynamic: one kernel for every parameter size. emulate_precision_casts: inductor otherwise folds the bf16
    # round trip in kahan's `w - weight.float()` into `w - w`, and the compensation would always be 0.
    return torch.compile(adamw_update, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True})
