"""The model definition shared by the trainer, `hlat describe` and the planner (torch-free).

Parameter and FLOP counts are analytic, so a 70B model is described without building it; the tests check
these formulas against the real modules built on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from hlat.fields import ConfigError, update


@dataclass
class ModelConfig:
    preset: str = ""  # name the config started from; informational once resolved
    family: Literal["llama", "neox"] = "llama"
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0  # 0 means n_heads (no grouped-query attention)
    ffn_dim: int = 688
    vocab_size: int = 8192
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rotary_pct: float = 1.0  # fraction of each head's dimensions that are rotated (NeoX/Pythia: 0.25)
    tie_embeddings: bool = False
    parallel_residual: bool = True  # NeoX only: x + attn(ln1(x)) + mlp(ln2(x))
    init_std: float = 0.02  # output projections use init_std / sqrt(2 * n_layers)
    # attend only within each packed document, positions restarting per document (the loader then also
    # yields doc_ids and positions)
    doc_mask: bool = False
    # tokens per chunk of the output layer and loss: the loss and its gradients are computed chunk by chunk from
    # the hidden states, never holding the [tokens, vocab] logits (hlat.models.loss.linear_cross_entropy);
    # 0 = the whole logits at once (the plain path, for comparison)
    loss_chunk: int = 2048
    # Mixture of experts (llama only; docs/moe.md)
    n_experts: int = 0  # experts in each block's MLP, each a SwiGLU of ffn_dim (0: a dense model)
    # the experts each token runs through: those its router scores highest (softmax, renormalised over them)
    experts_per_token: int = 2
    # tokens an expert takes per sequence, as a multiple of an even share (seq_len x experts_per_token / n_experts);
    # the later tokens of a sequence past it are dropped (they skip that expert). 0: none is dropped
    capacity_factor: float = 0.0
    aux_loss_coef: float = 0.01  # the load-balancing loss's weight (Switch Transformer's; Mixtral's is 0.02)

    # --- derived shapes -------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_pct)

    @property
    def has_bias(self) -> bool:
        return self.family == "neox"

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    def validate(self) -> ModelConfig:
        def bad(field: str, why: str) -> ConfigError:
            return ConfigError(f"model.{field}: {why}")

        for field in ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            if getattr(self, field) <= 0:
                raise bad(field, f"must be positive, got {getattr(self, field)}")
        if self.loss_chunk < 0:
            raise bad("loss_chunk", f"must be >= 0 (0: the whole logits at once), got {self.loss_chunk}")
        if self.n_kv_heads < 0:
            raise bad("n_kv_heads", f"must be >= 0, got {self.n_kv_heads}")
        if self.dim % self.n_heads:
            raise bad("dim", f"{self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise bad("n_heads", f"{self.n_heads} is not divisible by n_kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise bad("dim", f"head dimension {self.head_dim} must be even for rotary embeddings")
        if not 0.0 < self.rotary_pct <= 1.0:
            raise bad("rotary_pct", f"must be in (0, 1], got {self.rotary_pct}")
        if self.rotary_dim % 2 or (self.head_dim - self.rotary_dim) % 2:
            raise bad("rotary_pct", f"{self.rotary_pct} gives an odd split of head dimension {self.head_dim}")
        if self.family == "llama" and self.rotary_pct != 1.0:
            raise bad("rotary_pct", "partial rotary is a NeoX feature; llama rotates the whole head")
        if self.norm_eps <= 0 or self.rope_theta <= 0 or self.init_std <= 0:
            raise bad("norm_eps/rope_theta/init_std", "must be positive")
        return self.validate_experts(bad)

    def validate_experts(self, bad) -> ModelConfig:
        if self.n_experts < 0:
            raise bad("n_experts", f"must be >= 0 (0: a dense model), got {self.n_experts}")
        if not self.moe:
            return self
        if self.family != "llama":
            raise bad("n_experts", "mixture-of-experts blocks are built for the llama family only")
        if not 1 <= self.experts_per_token <= self.n_experts:
            k = self.experts_per_token
            raise bad("experts_per_token", f"must be between 1 and n_experts {self.n_experts}, got {k}")
        if self.capacity_factor < 0 or self.aux_loss_coef < 0:
            raise bad("capacity_factor/aux_loss_coef", "must be >= 0")
        return self

    # --- counts ---------------------------------------------------------------------------------
    def layer_params(self, experts: int | None = None) -> int:
        """One layer's parameters; of a mixture-of-experts layer, with `experts` of its experts (default: all of
        them; `experts_per_token`: those a token runs through) beside its router."""
        d, hd, f = self.dim, self.head_dim, self.ffn_dim
        qkv_out = d + 2 * self.kv_heads * hd
        attn = d * qkv_out + d * d
        if self.moe:  # each expert a SwiGLU; the router one row per expert
            return attn + (self.n_experts if experts is None else experts) * 3 * d * f + self.n_experts * d + 2 * d
        if self.family == "llama":
            return attn + 3 * d * f + 2 * d  # SwiGLU has three matrices; two RMSNorm weights
        # NeoX: biases on every linear, LayerNorm weight and bias twice
        return attn + qkv_out + d + 2 * d * f + f + d + 4 * d

    def expert_params(self) -> int:
        """One expert's parameters (0 in a dense model)."""
        return 3 * self.dim * self.ffn_dim if self.moe else 0

    def embedding_params(self) -> int:
        """Input embedding plus the output projection when it is a separate matrix."""
        return self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)

    def num_params(self, embedding: bool = True) -> int:
        """Every parameter the model stores (of a mixture of experts, every expert's)."""
        return self.active_params(embedding, self.n_experts if self.moe else None)

    def active_params(self, embedding: bool = True, experts: int | None = None) -> int:
        """The parameters one token's forward pass runs through: of a mixture of experts, its `experts_per_token`
        experts of each layer (or `experts`), not all of them; of a dense model, all."""
        final_norm = self.dim * (2 if self.family == "neox" else 1)
        body = self.n_layers * self.layer_params(experts or self.experts_per_token) + final_norm
        return body + (self.embedding_params() if embedding else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6 x the matmul parameters a token runs through (its
        experts, not every expert), including the output projection, plus causal-agnostic attention scores and
        values, 12 x layers x dim x seq_len (PaLM)."""
        matmul_params = self.active_params(embedding=False) + self.vocab_size * self.dim
        return 6.0 * matmul_params + 12.0 * self.n_layers * self.dim * seq_len


PRESETS: dict[str, dict] = {
    # CPU sizes: `tiny` is the `make train` default, `small` (~110M) the benchmark size.
    "tiny": dict(family="llama", dim=256, n_layers=4, n_heads=4, ffn_dim=688, vocab_size=8192, max_seq_len=1024),
    "small": dict(
        family="llama",
        dim=768,
        n_layers=12,
        n_heads=12,
        ffn_dim=2048,
        vocab_size=32000,
        max_seq_len=2048,
        tie_embeddings=True,
    ),
    "tiny-moe": dict(
        family="llama",
        dim=256,
        n_layers=4,
        n_heads=4,
        ffn_dim=256,
        vocab_size=8192,
        max_seq_len=1024,
        n_experts=8,
        experts_per_token=2,
    ),
    "tiny-neox": dict(
        family="neox", dim=256, n_layers=4, n_heads=4, ffn_dim=1024, vocab_size=8192, max_seq_len=1024, rotary_pct=0.25
    ),
    "small-neox": dict(
        family="neox",
        dim=768,
        n_layers=12,
        n_heads=12,
        ffn_dim=3072,
        vocab_size=32000,
        max_seq_len=2048,
        rotary_pct=0.25,
        tie_embeddings=True,
    ),
    # Published models; parameter counts are tested to equal the published ones exactly.
    "llama2-7b": dict(
        family="llama",
        dim=4096,
        n_layers=32,
        n_heads=32,
        ffn_dim=11008,
        vocab_size=32000,
        max_seq_len=4096,
        init_std=0.021,
    ),
    "llama2-13b": dict(
        family="llama",
        dim=5120,
        n_layers=40,
        n_heads=40,
        ffn_dim=13824,
        vocab_size=32000,
        max_seq_len=4096,
        init_std=0.021,
    ),
    "llama2-70b": dict(
        family="llama",
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        vocab_size=32000,
        max_seq_len=4096,
        init_std=0.021,
    ),
    "llama3-8b": dict(
        family="llama",
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    # Mixtral 8x7B (Jiang et al. 2024, and the released config.json): 8 SwiGLU experts of 14336 per layer, 2 per
    # token, no shared expert; the load-balancing loss at the released router_aux_loss_coef
    "mixtral-8x7b": dict(
        family="llama",
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=32000,
        max_seq_len=32768,
        rope_theta=1e6,
        n_experts=8,
        experts_per_token=2,
        aux_loss_coef=0.02,
    ),
    "pythia-6.9b": dict(
        family="neox",
        dim=4096,
        n_layers=32,
        n_heads=32,
        ffn_dim=16384,
        vocab_size=50432,
        max_seq_len=2048,
        rotary_pct=0.25,
    ),
    "neox-20b": dict(
        family="neox",
        dim=6144,
        n_layers=44,
        n_heads=64,
        ffn_dim=24576,
        vocab_size=50432,
        max_seq_len=2048,
        rotary_pct=0.25,
    ),
}


def preset_config(preset: str = "") -> ModelConfig:
    """The ModelConfig of a preset name ('' for the defaults), not yet validated."""
    if not preset:
        return ModelConfig()
    if preset not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    return replace(ModelConfig(), preset=preset, **PRESETS[preset])


def model_config(preset: str = "", **overrides) -> ModelConfig:
    """A validated ModelConfig from a preset name and field overrides (as in a `[model]` table)."""
    return update(preset_config(preset), overrides, "model.").validate()
