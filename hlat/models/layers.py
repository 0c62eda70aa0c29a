"""Layers shared by the model families: rotary embeddings, attention, the two MLPs and weight init."""

from __future__ import annotations

import functools
import math
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from hlat.dtensor import local
from hlat.models.config import ModelConfig
from hlat.models.context import SequenceSplit
from hlat.models.kv_cache import KVCache, LayerCache
from hlat.models.loss import IGNORE_INDEX, cross_entropy, linear_cross_entropy


def rope_table(cfg: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """cos and sign-folded sin per position, shape [max_seq_len, 2, head_dim], float32.

    Partial rotary uses the zero-frequency trick: the rotated dimension pairs (j, j + head_dim/2) get the
    usual inverse frequencies for the first rotary_dim/2 pairs and frequency 0 for the rest (cos 1, sin 0),
    so the whole head is rotated in one operation with no slicing into rotated and passed-through parts.
    """
    rot, half = cfg.rotary_dim, cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2, device=device, dtype=torch.float32) / rot))
    inv_freq = F.pad(inv_freq, (0, half - rot // 2))
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos().repeat(1, 2), angles.sin()
    # rotate_half(x) = (-x2, x1) = swap_halves(x) * (-1, +1): fold the sign into sin.
    signed_sin = torch.cat([-sin, sin], dim=-1)
    return torch.stack([cos, signed_sin], dim=1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim]; rope: [seq, 2, head_dim] or [batch, seq, 2, head_dim]."""
    cos, sin = rope.unbind(-2)
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return x * cos + swapped * sin


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor | BlockMask:
    """Where a query may attend a key in rows of packed documents (`doc_ids` [batch, seq]): causal, and both in
    the same document (`attention_mask` of the rows in their own order)."""
    index = row_positions(doc_ids)
    return attention_mask(index, index, doc_ids, doc_ids)


def row_positions(t: torch.Tensor) -> torch.Tensor:
    """Each token's position in its row of `t` [batch, seq]."""
    return torch.arange(t.shape[1], device=t.device).expand_as(t)


def attention_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    query_docs: torch.Tensor | None = None,
    key_docs: torch.Tensor | None = None,
) -> torch.Tensor | BlockMask:
    """Where a query may attend a key, from their true positions [batch, queries] and [batch, keys] (in the row,
    or in the document with `*_docs`, the documents' ids): a key at or before the query's position, and with
    document ids in the query's document. On CUDA a FlexAttention BlockMask, so attention skips the blocks no query
    sees and no [queries, keys] mask exists; elsewhere a dense [batch, 1, queries, keys] bool mask for SDPA
    (FlexAttention has no backward pass on the CPU). `Attention` runs whichever kernel the mask is for."""
    if query_positions.device.type == "cuda":
        return block_sparse_mask(query_positions, key_positions, query_docs, key_docs)
    return dense_mask(query_positions, key_positions, query_docs, key_docs)


def dense_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    query_docs: torch.Tensor | None = None,
    key_docs: torch.Tensor | None = None,
) -> torch.Tensor:
    """`attention_mask` as a [batch, 1, queries, keys] bool tensor, True where a query may attend a key."""
    mask = key_positions[:, None, :] <= query_positions[:, :, None]
    if query_docs is not None:
        mask &= key_docs[:, None, :] == query_docs[:, :, None]
    return mask.unsqueeze(1)


def block_sparse_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    query_docs: torch.Tensor | None = None,
    key_docs: torch.Tensor | None = None,
) -> BlockMask:
    """`attention_mask` as FlexAttention's block-sparse mask, one for every head (so a tensor-parallel rank's local
    heads use it as it is)."""

    def visible(batch, head, query, key):
        seen = key_positions[batch, key] <= query_positions[batch, query]
        return seen if query_docs is None else seen & (query_docs[batch, query] == key_docs[batch, key])

    batch, queries = query_positions.shape
    return create_block_mask(visible, batch, None, queries, key_positions.shape[1], device=query_positions.device)


def additive(mask: torch.Tensor | BlockMask | None, dtype: torch.dtype) -> torch.Tensor | BlockMask | None:
    """A dense bool mask as SDPA's additive one in the queries' dtype (0 where seen, -inf elsewhere), made once for
    every layer: given a bool mask, SDPA would make (and keep for backward) such a copy in each layer."""
    if not isinstance(mask, torch.Tensor):
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, gqa: bool) -> torch.Tensor:
    """flex_attention, compiled as it must be (uncompiled it materialises the whole score matrix): traced into
    the graph of a compiled block (`parallel.compile`), else compiled once per process."""
    kernel = flex_attention if torch.compiler.is_compiling() else compiled_flex_attention()
    return kernel(q, k, v, block_mask=block_mask, enable_gqa=gqa)


@functools.cache
def compiled_flex_attention():
    return torch.compile(flex_attention)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hd, bias = cfg.head_dim, cfg.has_bias
        self.head_dim = hd
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=bias)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=bias)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=bias)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=bias)
        self.split: SequenceSplit | None = None  # context parallelism (hlat.parallel.context)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None, cache: LayerCache | None = None
    ) -> torch.Tensor:
        # Head counts come from the weights' shapes, so a tensor-parallel shard sees its local heads.
        q = self.wq(x).unflatten(-1, (-1, self.head_dim))
        k = self.wk(x).unflatten(-1, (-1, self.head_dim))
        v = self.wv(x).unflatten(-1, (-1, self.head_dim))
        if rope.dim() == 3:  # the whole table: the first seq_len positions
            rope = rope[: q.shape[1]]
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if self.split is not None:  # this rank's queries attend every rank's keys
            k, v = self.split.gather(k, 1), self.split.gather(v, 1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cache is not None:  # generation: attend to the cached keys and values of earlier positions too
            k, v = cache.store(k, v)
        gqa = k.shape[1] != q.shape[1]
        if isinstance(mask, BlockMask):
            out = flex(q, k, v, mask, gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).flatten(-2))


def compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in for the residual stream `h`: autocast's, else h's own."""
    device = h.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GeluMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


OUTPUT_PROJECTIONS = ("wo", "w2")  # written into the residual stream: initialised with a smaller std


DRAW_CHUNK = 2**22  # elements one generator draws: a larger parameter's chunks are drawn by parallel threads


def initial_value(param: torch.Tensor, name: str, std: float, seed: int) -> torch.Tensor:
    """The full fp32 initial value of parameter `name`: normal(0, std), or ones/zeros for std 1.0/0.0.

    Each parameter draws from its own generators seeded by (seed, name), not from the global RNG, so its value
    does not depend on which other parameters a process holds: every parallel layout starts from the weights
    a single process would have. Each DRAW_CHUNK elements have a generator of their own, so that the chunks of a
    large parameter are drawn at once on torch's intra-op threads (one core draws a llama2-7b in about 40 s; under
    torchrun a rank has one thread unless OMP_NUM_THREADS gives it more)."""
    # torch's CPU generator keeps only the low 32 bits of its seed: the run's seed is mixed into them (seed 0 keeps
    # each parameter's crc32), so that train.seed changes every weight; chunk k > 0 adds k times another odd constant
    base = zlib.crc32(name.encode()) + seed * 0x9E3779B1
    value = torch.empty(param.shape, dtype=torch.float32)
    if std in (0.0, 1.0) or value.numel() <= DRAW_CHUNK:
        return draw_into(value, std, torch.Generator().manual_seed(base % 2**32))
    flat = value.view(-1)

    def draw_chunk(k: int) -> None:
        generator = torch.Generator().manual_seed((base + k * 0x85EBCA6B) % 2**32)
        draw_into(flat[k * DRAW_CHUNK : (k + 1) * DRAW_CHUNK], std, generator)

    with ThreadPoolExecutor(torch.get_num_threads()) as pool:  # torch releases the GIL while it draws
        list(pool.map(draw_chunk, range(math.ceil(flat.numel() / DRAW_CHUNK))))
    return value


def draw_into(value: torch.Tensor, std: float, generator: torch.Generator) -> torch.Tensor:
    """`value` filled with normal(0, std), or ones/zeros for std 1.0/0.0 (which take nothing from `generator`)."""
    return value.fill_(std) if std in (0.0, 1.0) else value.normal_(0.0, std, generator=generator)


def fill_parameter(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a full value into a parameter; a sharded (DTensor) parameter keeps only its own shard."""
    if isinstance(param, DTensor):
        # every rank computed the same full value, so each cuts its shard locally (src_data_rank=None: no comms)
        value = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param = param.to_local()
    param.copy_(value)


def draw_shard(param: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """`initial_value`'s distribution for this rank's shard of a parameter alone."""
    shard = local(param)
    shard.copy_(draw_into(torch.empty(shard.shape, dtype=torch.float32), std, generator))  # on the CPU, in fp32


def init_std(cfg: ModelConfig, module_name: str, module: nn.Module, param_name: str) -> float:
    """HLAT's init: normal(init_std) matrices and embeddings, residual output projections scaled by
    1/sqrt(2 n_layers), zero biases, unit norm weights. 0.0 and 1.0 mean constant fills."""
    if param_name == "bias":
        return 0.0
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return 1.0
    if module_name.rsplit(".", 1)[-1] in OUTPUT_PROJECTIONS or param_name in OUTPUT_PROJECTIONS:  # experts' w2 too
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std


class Block(nn.Module):
    """One transformer layer: sequential (x + attn, then + mlp) or parallel (x + attn(ln1 x) + mlp(ln2 x))."""

    def __init__(self, cfg: ModelConfig, norm: type[nn.Module], mlp: type[nn.Module], parallel_residual: bool):
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = mlp(cfg)
        self.attention_norm = norm(cfg.dim, eps=cfg.norm_eps)
        self.ffn_norm = norm(cfg.dim, eps=cfg.norm_eps)
        self.parallel_residual = parallel_residual

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None, cache: LayerCache | None = None
    ) -> torch.Tensor:
        # the cache goes by keyword: tensor parallelism's input plan covers the positional arguments only
        h = x + self.attention(self.attention_norm(x), rope, mask, cache=cache)
        return h + self.feed_forward(self.ffn_norm(x if self.parallel_residual else h))


class Transformer(nn.Module):
    """Embedding, blocks keyed "0", "1", ..., final norm and output projection.

    A part set to None (or a block deleted from `layers`) is skipped, so a pipeline stage keeps only the parts
    it owns; a stage without `tok_embeddings` takes hidden states instead of tokens.
    """

    def __init__(self, cfg: ModelConfig, norm: type[nn.Module], mlp: type[nn.Module], parallel_residual: bool):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, norm, mlp, parallel_residual) for i in range(cfg.n_layers)})
        self.norm = norm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Derived from the config, not learned: kept out of state dicts and rebuilt by init_buffers.
        self.register_buffer("rope", rope_table(cfg), persistent=False)
        self.split: SequenceSplit | None = None  # context parallelism (hlat.parallel.context)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        targets: torch.Tensor | None = None,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """tokens [batch, seq] (or hidden states); `positions` [batch, seq] index the rotary table (packed
        documents restart at 0); with `doc_ids` [batch, seq] a token attends only within its document.
        With a `cache` (generation), tokens continue the sequence the cache holds (see hlat.models.generate).
        Under context parallelism (`split`) each is this rank's part of the sequences, `positions` required.
        Returns the logits, or with `targets` [batch, seq] (-100: ignored) the loss (`loss`); a part without the
        output layer (a pipeline stage) returns its hidden states and leaves the targets to the last one."""
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        if cache is not None:
            positions, mask = cache.positions_and_mask(tokens.shape[1])
        else:
            mask = additive(self.attention_mask(positions, doc_ids), compute_dtype(h))
        # the whole table, cut to length inside attention: under sequence parallelism h holds only this
        # rank's part of the sequence, while attention sees all of it
        rope = self.rope if positions is None else self.rope[positions]
        for name, layer in self.layers.items():
            if layer is not None:
                h = layer(h, rope, mask) if cache is None else layer(h, rope, mask, cache=cache.layer(int(name)))
        if cache is not None:
            cache.advance(tokens.shape[1])
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        return self.output(h) if targets is None else self.loss(h, targets, reduction)

    def attention_mask(
        self, positions: torch.Tensor | None, doc_ids: torch.Tensor | None
    ) -> torch.Tensor | BlockMask | None:
        """None (causal attention) for whole rows without documents, else `attention_mask`; under context
        parallelism this rank's queries against every rank's keys, their positions and documents gathered."""
        if self.split is None:
            return None if doc_ids is None else document_mask(doc_ids)
        key_docs = None if doc_ids is None else self.split.gather(doc_ids, 1)
        return attention_mask(positions, self.split.gather(positions, 1), doc_ids, key_docs)

    def loss(self, h: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """The token cross-entropy of the final norm's output `h` (fp32 scalar, "mean" over the counted targets or
        "sum"): chunk by chunk from the output weight with `model.loss_chunk` (never holding the logits), else
        from the whole logits. Either way vocabulary-parallel under tensor parallelism, and a plain tensor.

        Under context parallelism each rank returns cp x its tokens' share of the whole sequences' loss (the mean
        over every rank's counted targets), so that the ranks' values average to it, as data-parallel ranks'
        losses and gradients are averaged (FSDP averages the gradients over dp_shard x cp)."""
        split = self.split is not None
        reduced = "sum" if split else reduction
        if self.cfg.loss_chunk:
            loss = linear_cross_entropy(h, self.output.weight, targets, reduced, self.cfg.loss_chunk)
        else:
            loss = cross_entropy(self.output(h), targets, reduced)
        if not split:
            return loss
        if reduction == "mean":
            return loss * (self.split.size / self.split.total((targets != IGNORE_INDEX).sum()))
        return loss * self.split.size

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Rebuild the rope table (derived from the config: no checkpoint holds it)."""
        self.rope.copy_(rope_table(self.cfg, device=self.rope.device))

    @torch.no_grad()
    def init_weights(self, seed: int = 0, per_shard: bool = False) -> None:
        """Initialise every parameter this module holds: from its full value (`initial_value`), or `per_shard`
        (`hlat.models.materialize`) this rank's shard alone."""
        generator = torch.Generator().manual_seed(seed)
        done: set[int] = set()  # a tied output matrix is the embedding: initialise it once
        for module_name, module in self.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                if id(param) not in done:
                    done.add(id(param))
                    name = f"{module_name}.{param_name}"
                    std = init_std(self.cfg, module_name, module, param_name)
                    if per_shard:
                        draw_shard(param, std, generator)
                    else:
                        fill_parameter(param, initial_value(param, name, std, seed))
