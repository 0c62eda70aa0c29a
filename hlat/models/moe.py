"""Mixture-of-experts blocks for the llama family (docs/moe.md): a router, `n_experts` SwiGLU experts, and the
routing figures a run logs.

Each token goes to the `experts_per_token` experts its router scores highest (a softmax over every expert, then
renormalised over the chosen ones, as Mixtral), and its output is their outputs so weighted. No expert is shared.
The load is balanced by the Switch Transformer's auxiliary loss, taken over each sequence (as DeepSeek-V3's
sequence-wise one) and averaged: n_experts x sum over experts of (the share of the sequence's choices it got) x (its
mean router probability over the sequence's tokens), weighted by `aux_loss_coef`. Over sequences, not micro-batches,
so that the objective is the same at any micro-batch size. Its gradient is added in backward (`LoadBalance`), so a
pipeline stage without the loss adds it too. With `capacity_factor`, an expert takes at most that multiple of an
even share of each sequence's choices, the earlier tokens first; the later ones skip it. Only training drops tokens:
evaluation and generation route every token (no gradient is taken there).

The routing is the single process's in every layout: each token is routed on its own, and what spans tokens (the
capacity's order, the loss's shares) is taken over whole sequences of a micro-batch, gathered from the ranks that
split them. Parallelism reaches in through three attributes set from outside (`hlat.parallel`): `dispatch` (expert
parallelism, `experts.py`: the experts live on several ranks, tokens travel by all-to-all), `tp` (tensor
parallelism, `tensor.py`: the ranks whose sequence shards this rank routes alongside its own, each holding a slice
of every expert) and `cp` (context parallelism, `context.py`: the ranks holding the other chunks of its
sequences)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hlat.dtensor import local
from hlat.models.config import ModelConfig
from hlat.models.context import SequenceSplit
from hlat.models.layers import compute_dtype


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [tokens, in] in consecutive groups of `counts` [experts] rows, group i times weight[i] [out, in] transposed
    (both in the compute dtype): torch's grouped matmul where the device has one (bf16 on CUDA), else one matmul
    per expert."""
    if x.device.type == "cuda" and x.dtype == torch.bfloat16:
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=counts.cumsum(0, dtype=torch.int32))
    return torch.cat([F.linear(rows, weight[i]) for i, rows in enumerate(x.split(counts.tolist()))])


class GroupedExperts(nn.Module):
    """The experts' SwiGLU weights stacked, [experts, out, in] each (an expert parallel rank holds its experts',
    a tensor-parallel rank its slice of their ffn_dim)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, d, f = cfg.n_experts, cfg.dim, cfg.ffn_dim
        self.w1 = nn.Parameter(torch.empty(e, f, d))  # gate
        self.w3 = nn.Parameter(torch.empty(e, f, d))  # up
        self.w2 = nn.Parameter(torch.empty(e, d, f))  # down
        self.grad_scale = 1.0  # what each weight's gradient is multiplied by (hlat.parallel.experts)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: tokens grouped by expert, `counts` of each of this rank's experts. The tokens and each weight are cast
        to the compute dtype once (as autocast would cast every expert's slice apart, each kept for backward)."""
        dtype = compute_dtype(x)
        w1, w2, w3 = (self.weight(w, dtype) for w in (self.w1, self.w2, self.w3))
        x = x.to(dtype)
        return grouped_linear(F.silu(grouped_linear(x, w1, counts)) * grouped_linear(x, w3, counts), w2, counts)

    def weight(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        w = local(w)
        if self.grad_scale != 1.0 and w.requires_grad:
            w.register_hook(lambda grad: grad * self.grad_scale)
        return w.to(dtype)


class _AllToAll(torch.autograd.Function):
    """dist.all_to_all_single with its gradient (the reverse exchange)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sends: list[int], receives: list[int], group) -> torch.Tensor:
        ctx.sends, ctx.receives, ctx.group = sends, receives, group
        out = x.new_empty(sum(receives), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), receives, sends, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.receives, ctx.sends, ctx.group), None, None, None


@dataclass(frozen=True, eq=False)
class ExpertDispatch:
    """The expert-parallel ranks a layer's experts are spread over, in order: rank r holds experts
    r x n / size to (r + 1) x n / size - 1."""

    group: dist.ProcessGroup
    size: int

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        """`tokens` grouped by expert (`counts` [n_experts] each) through their experts on their ranks, returned in
        the same order: to each rank its experts' tokens by all-to-all, which arrive by source rank, are grouped
        by expert for the matmuls and go back the same way."""
        sent = counts.view(self.size, -1)
        received = sent.clone()  # what a fake process group (hlat rehearse) leaves: every peer routing as this rank
        dist.all_to_all_single(received, sent.contiguous(), group=self.group)
        sends, receives = sent.sum(1).tolist(), received.sum(1).tolist()
        arrived = _AllToAll.apply(tokens, sends, receives, self.group)
        # each arrived token's (source, expert) block, ordered by expert then source
        block = torch.repeat_interleave(torch.arange(received.numel(), device=tokens.device), received.flatten())
        local_experts = received.shape[1]
        by_expert = ((block % local_experts) * self.size + block // local_experts).argsort(stable=True)
        out = experts(arrived[by_expert], received.sum(0))
        return _AllToAll.apply(out[by_expert.argsort()], receives, sends, self.group)


class LossGrad:
    """The gradient the micro-batch's loss received (its share of the step's objective), which the load-balancing
    loss takes as its own: the trainer's 1 / micro-batches, or 1 on a pipeline stage (the schedule scales every
    gradient afterwards; a stage without the loss never records one)."""

    def __init__(self):
        self.value: torch.Tensor | float = 1.0

    def recorded(self, loss: torch.Tensor) -> torch.Tensor:
        return _RecordGrad.apply(loss, self)


class _RecordGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss: torch.Tensor, holder: LossGrad) -> torch.Tensor:
        ctx.holder = holder
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.holder.value = grad.detach()
        return grad, None


class LoadBalance(torch.autograd.Function):
    """The block's output unchanged; in backward, the load-balancing loss's gradient (`aux_loss_coef` times what the
    micro-batch's loss received, `LossGrad`) into the router, and the layer's routing figures counted: once per
    micro-batch, whether or not recomputation runs the forward again."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, moe: MoE, figures: torch.Tensor) -> torch.Tensor:
        ctx.moe, ctx.figures = moe, figures
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        moe = ctx.moe
        moe.load = ctx.figures if moe.load is None else moe.load + ctx.figures
        scale = torch.as_tensor(moe.loss_grad.value, dtype=torch.float32, device=grad.device) * moe.aux_loss_coef
        return grad, scale, None, None


class MoE(nn.Module):
    """A mixture-of-experts MLP: `router` (dim -> n_experts) and `experts`. Its routing figures of the steps since
    they were last read (`routing_table`) are kept in `load`: per expert its share of the choices (before any is
    dropped), then the dropped choices, the load-balancing loss and the micro-batches, each rank holding its share."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.experts_per_token
        self.capacity_factor, self.aux_loss_coef = cfg.capacity_factor, cfg.aux_loss_coef
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg)
        self.dispatch: ExpertDispatch | None = None
        self.tp: SequenceSplit | None = None
        self.cp: SequenceSplit | None = None
        self.loss_grad = LossGrad()  # the model's own (`hlat.models.llama.Llama`)
        self.load: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)  # under tensor parallelism, of this rank's shard of the sequences
        probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        own_probs = probs.sum(1)  # [batch, experts]: this rank's tokens of each sequence
        if self.tp is not None:  # route every shard of the sequences alike: each rank holds a slice of each expert
            x, weights, chosen = (self.tp.gather(t, 1) for t in (x, weights, chosen))
        training = torch.is_grad_enabled()
        kept = self.within_capacity(chosen) if training and self.capacity_factor else None
        y = self.run_experts(x.flatten(0, 1), chosen.flatten(), None if kept is None else kept.flatten())
        batch, seq, dim = x.shape
        out = torch.bmm(weights.to(y.dtype).view(-1, 1, self.top_k), y.view(-1, self.top_k, dim)).view(batch, seq, dim)
        if not training:
            return out
        aux, figures = self.balance(chosen, kept, own_probs)
        return LoadBalance.apply(out, aux, self, figures)

    def run_experts(self, tokens: torch.Tensor, chosen: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
        """Each (token, choice)'s expert output, [tokens x experts_per_token, dim], zero where the choice was
        dropped: the choices sorted by expert, run grouped (on the experts' ranks), put back in place."""
        order = chosen.argsort(stable=True)
        if kept is not None:
            order = order[kept[order]]
        counts = torch.bincount(chosen[order], minlength=self.n_experts)
        grouped = tokens[order // self.top_k].to(compute_dtype(tokens))  # what the experts compute in, sent so
        out = self.experts(grouped, counts) if self.dispatch is None else self.dispatch(grouped, counts, self.experts)
        # each choice's row of `out`, a dropped one's a row of zeros after them (indexing keeps only the indices)
        row = torch.full_like(chosen, len(order)).index_copy(0, order, torch.arange(len(order), device=order.device))
        return torch.cat([out, out.new_zeros(1, out.shape[-1])])[row]

    def within_capacity(self, chosen: torch.Tensor) -> torch.Tensor:
        """Which choices [batch, seq, k] an expert takes: those of the first `capacity_factor` x seq x k / n_experts
        tokens of each sequence that chose it. Under context parallelism this rank's chunks start after the choices of
        the chunks before them, which the cp ranks exchange."""
        chose = F.one_hot(chosen, self.n_experts).sum(2)  # [batch, seq, experts]: 0 or 1 (the k choices differ)
        seq = chose.shape[1] * (1 if self.cp is None else self.cp.size)
        if self.cp is None:
            before = chose.cumsum(1) - chose
        else:  # this rank's two chunks of each sequence (hlat.parallel.context)
            chunks = chose.unflatten(1, (2, -1))
            before = (chunks.cumsum(2) - chunks + self.chunk_starts(chunks.sum(2))[:, :, None]).flatten(1, 2)
        capacity = math.ceil(self.capacity_factor * seq * self.top_k / self.n_experts)
        return before.gather(2, chosen) < capacity

    def chunk_starts(self, per_chunk: torch.Tensor) -> torch.Tensor:
        """[batch, 2, experts]: the choices of each expert in the chunks before each of this rank's two (its
        `per_chunk`), over the cp ranks' chunks in sequence order (rank r holds chunks r and 2 cp - 1 - r)."""
        every = self.cp.gather(per_chunk.unsqueeze(0), 0)  # [cp, batch, 2, experts]
        in_order = torch.cat([every[:, :, 0], every[:, :, 1].flip(0)])  # [2 cp, batch, experts]
        starts = in_order.cumsum(0) - in_order
        rank, cp = self.cp.mesh.get_local_rank(), self.cp.size
        return starts[[rank, 2 * cp - 1 - rank]].transpose(0, 1)

    def balance(
        self, chosen: torch.Tensor, kept: torch.Tensor | None, own_probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the micro-batch's load-balancing loss (its own tokens' probabilities against every
        choice of their sequences), times cp so that the cp ranks' average is the whole (FSDP averages their
        gradients), and the routing figures of its share (`load`)."""
        per_sequence = F.one_hot(chosen, self.n_experts).sum((1, 2)).float()  # [batch, experts]
        if self.cp is not None:
            per_sequence = self.cp.total(per_sequence)
        tp, cp = (1 if s is None else s.size for s in (self.tp, self.cp))
        seq = chosen.shape[1] * cp
        share = self.n_experts * (per_sequence / (seq * self.top_k) * own_probs / seq).sum() / len(chosen)
        dropped = chosen.numel() - kept.sum() if kept is not None else torch.zeros((), device=chosen.device)
        shares = torch.cat([torch.bincount(chosen.flatten(), minlength=self.n_experts), dropped.reshape(1)]) / tp
        mb = torch.ones(1, device=chosen.device) / (tp * cp)
        return share * cp, torch.cat([shares, share.detach().reshape(1), mb]).double()


def routing_table(parts: list[nn.Module]) -> torch.Tensor | None:
    """[layers, n_experts + 3] of this rank's routing figures since the last call (rows of the layers it does not
    hold zero), which then start again; summed over every rank they are the run's (`MoE.load`). None for a dense
    model."""
    cfg = parts[0].cfg
    if not cfg.moe:
        return None
    device = next(p.device for part in parts for p in part.parameters())
    table = torch.zeros(cfg.n_layers, cfg.n_experts + 3, dtype=torch.float64, device=device)
    for part in parts:
        for name, block in part.layers.items():
            moe = block.feed_forward
            if moe.load is not None:
                table[int(name)] = moe.load
                moe.load = None
    return table
