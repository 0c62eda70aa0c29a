"""The training loss: token cross-entropy in fp32 (or wider), whatever the compute dtype.

`cross_entropy` takes the logits; `linear_cross_entropy` takes the output layer's input and weight and never holds
the full [tokens, vocab] logits, the largest activation of a step with a 32k-128k vocabulary. The model calls one
of them (`model.loss_chunk`, hlat.models.layers.Transformer.loss), so every caller computes the loss one way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from hlat.dtensor import full

IGNORE_INDEX = -100  # F.cross_entropy's default: the target of a padding position


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Token loss of [batch, seq, vocab] logits against [batch, seq] targets (-100: ignored), in fp32 (fp64 for
    fp64 logits); the logits may be a vocabulary-sharded DTensor (under `loss_parallel`), the loss is a plain
    tensor either way."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)
    return full(loss)


@dataclass(frozen=True)
class Chunking:
    """How `linear_cross_entropy` runs: tokens per chunk, the matmuls' dtype, the dtype of the softmax and of
    every sum (fp32, or fp64 for an fp64 model), and under tensor parallelism the group sharing the vocabulary
    and the first vocabulary row this rank holds."""

    tokens: int
    compute: torch.dtype
    accumulate: torch.dtype
    group: dist.ProcessGroup | None = None
    vocab_start: int = 0


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str = "mean", chunk: int = 2048
) -> torch.Tensor:
    """The loss of `cross_entropy(hidden @ weight.T, targets)` (bias-free output layer), `chunk` tokens at a
    time: per chunk the logits in the compute dtype (autocast's, else the weight's), their log-softmax and loss
    in fp32 and, when a gradient is wanted, the gradients for the chunk's hidden states and (summed over chunks
    in fp32) for the weight, from softmax - one-hot. Backward only scales those by the incoming gradient: no
    matmul is repeated. What stays from forward to backward is a gradient the size of `hidden` and one the size
    of `weight` (fp32), instead of the logits; the largest transient is one chunk's logits (compute dtype) and
    log-probabilities (fp32).

    Under tensor parallelism `weight` is the output layer's vocabulary-sharded DTensor and the same fused path
    runs on local tensors (nothing is recomputed): each rank computes the logits of its vocabulary rows for every
    token (the hidden states gathered over the sequence first under sequence parallelism, as ColwiseParallel
    would), and the ranks exchange each chunk's partial log-sum-exp and target logit (one all-gather of 2 x chunk
    floats); the logits are never gathered. The hidden states' gradient is each rank's partial sum, reduced by
    DTensor's backward (an all-reduce, or a reduce-scatter to the sequence shards); the weight's stays with its
    shard. Returns a plain scalar tensor (the same on every rank)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    device = hidden.device.type
    compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    group, vocab_start = None, 0
    if isinstance(weight, DTensor):
        hidden, weight, group, vocab_start = vocabulary_parallel(hidden, weight)
    spec = Chunking(chunk, compute, torch.promote_types(compute, torch.float32), group, vocab_start)
    hidden, targets = hidden.flatten(0, -2), targets.flatten()
    counted = (targets != IGNORE_INDEX).sum().to(spec.accumulate)
    scale = counted.reciprocal() if reduction == "mean" else torch.ones_like(counted)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return LinearCrossEntropy.apply(hidden, weight, targets, scale, spec)
    return chunked_loss(hidden, weight, targets, scale, spec, grads=False)[0]


def vocabulary_parallel(
    hidden: torch.Tensor, weight: DTensor
) -> tuple[torch.Tensor, torch.Tensor, dist.ProcessGroup, int]:
    """This rank's local view of a vocabulary-parallel output layer: every token's hidden states (gathered from
    the sequence shards, or replicated already: a plain tensor), whose gradient is declared a partial sum over the
    ranks, the local rows of the weight, the tensor-parallel group and the first vocabulary row held here."""
    mesh = weight.device_mesh
    if tuple(weight.placements) != (Shard(0),):
        raise ValueError(
            f"a vocabulary-parallel output weight is Shard(0) over one mesh dimension, got {weight.placements}"
        )
    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    local_hidden = hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    local_weight = weight.to_local()
    return local_hidden, local_weight, mesh.get_group(), mesh.get_local_rank() * local_weight.shape[0]


class LinearCrossEntropy(torch.autograd.Function):
    """`chunked_loss` with its gradients, computed in forward and scaled by the loss's gradient in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, scale, spec: Chunking):
        loss, grad_hidden, grad_weight = chunked_loss(hidden, weight, targets, scale, spec, grads=True)
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            scaled(grad_hidden, grad_loss, grad_hidden.dtype),
            scaled(grad_weight, grad_loss, ctx.weight_dtype),
            None,
            None,
            None,
        )


def scaled(t: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t * factor in `dtype`: in place when t already is, else in one pass (no intermediate in t's dtype)."""
    return t.mul_(factor) if t.dtype == dtype else torch.mul(t, factor, out=torch.empty_like(t, dtype=dtype))


def chunked_loss(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, spec: Chunking, grads: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The loss (summed over the targets, times `scale`) of hidden [tokens, dim] against targets [tokens], and with
    `grads` its gradients for `hidden` (in hidden's dtype) and for `weight` (in the accumulation dtype)."""
    w = weight.to(spec.compute)
    loss = torch.zeros((), dtype=spec.accumulate, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if grads else None
    grad_weight = torch.zeros(weight.shape, dtype=spec.accumulate, device=weight.device) if grads else None
    for start in range(0, hidden.shape[0], spec.tokens):
        rows = slice(start, start + spec.tokens)
        h, t = hidden[rows].to(spec.compute), targets[rows]
        counted = t != IGNORE_INDEX
        local = t - spec.vocab_start  # the target's row in this rank's part of the vocabulary
        here = counted & (local >= 0) & (local < w.shape[0])
        index = local.clamp(0, w.shape[0] - 1)[:, None]
        token_loss, log_probs = log_probabilities(h @ w.T, index, here, spec)
        loss += torch.where(counted, token_loss, 0.0).sum()
        if grads:
            # d(loss)/d(logits) = (softmax - one-hot) * scale, zero for ignored targets, in the compute dtype
            g = log_probs.exp_().scatter_add_(1, index, -here.to(log_probs.dtype)[:, None])
            g = scaled(g, torch.where(counted, scale, 0.0)[:, None], spec.compute)
            grad_hidden[rows] = g @ w
            if g.dtype == grad_weight.dtype:
                grad_weight.addmm_(g.T, h)
            else:  # a bf16 product summed in fp32 (torch has no mixed-dtype addmm on every device)
                grad_weight += g.T @ h
    return loss * scale, grad_hidden, grad_weight


def log_probabilities(
    logits: torch.Tensor, index: torch.Tensor, here: torch.Tensor, spec: Chunking
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token of a chunk: the loss -log p(target) and the log-probabilities of this rank's vocabulary rows
    [tokens, rows] (in the accumulation dtype, from one fused log-softmax of the compute-dtype logits). Under
    tensor parallelism (`spec.group`) the ranks exchange their rows' log-sum-exp and the target's logit (0 on the
    ranks without it): one all-gather of 2 x tokens floats, after which the local log-softmax is shifted to the
    whole vocabulary's."""
    log_probs = torch.log_softmax(logits, -1, dtype=spec.accumulate)
    if spec.group is None:
        return -log_probs.gather(1, index)[:, 0], log_probs
    # log-sum-exp of the local rows from the largest logit, whose log-probability is within log(rows) of 0
    lse = logits.amax(-1).to(spec.accumulate) - log_probs.amax(-1)
    target_logit = torch.where(here, logits.gather(1, index)[:, 0].to(spec.accumulate), 0.0)
    parts = torch.empty(dist.get_world_size(spec.group) * 2, *lse.shape, dtype=lse.dtype, device=lse.device)
    dist.all_gather_into_tensor(parts, torch.stack([lse, target_logit]), group=spec.group)  # rank by rank
    total = parts[0::2].logsumexp(0)
    return total - parts[1::2].sum(0), log_probs.add_((lse - total)[:, None])
