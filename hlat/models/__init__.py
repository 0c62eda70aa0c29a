"""Model construction. Torch is imported lazily so `hlat.models.config` stays torch-free for the planner."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from hlat.models.config import ModelConfig


def build_model(cfg: ModelConfig, device: torch.device | str = "meta") -> nn.Module:
    """The model of `cfg.family`, built on the meta device (a 70B model allocates nothing), then materialised
    on `device` unless that is meta too."""
    import torch

    from hlat.models.llama import Llama
    from hlat.models.neox import GPTNeoX

    cfg.validate()
    with torch.device("meta"):
        model = {"llama": Llama, "neox": GPTNeoX}[cfg.family](cfg)
    return model if torch.device(device).type == "meta" else materialize(model, device)


WEIGHTS = ("drawn", "per_shard", "loaded")


def materialize(model: nn.Module, device: torch.device | str, seed: int = 0, weights: str = "drawn") -> nn.Module:
    """Allocate the (meta) model's storage on `device`, build the rope table and initialise the weights:
    - "drawn": each parameter's full value from its own generators, so the weights depend only on `seed`, not on
      how the model was split or sharded before this call (a fresh run). Every rank draws the full value of each
      parameter it holds a shard of, a large parameter's chunks on torch's intra-op threads (`initial_value`):
      4.8 s per billion parameters on 2 CPU threads;
    - "per_shard": each rank draws its own shards alone, from one generator: the same distributions at a shard's
      cost, values that depend on the layout (a rehearsal);
    - "loaded": left as allocated, a checkpoint's weights about to be loaded over them (a resume)."""
    import torch

    if weights not in WEIGHTS:
        raise ValueError(f"weights: {weights!r} is not one of {WEIGHTS}")
    model.to_empty(device=device)
    # to_empty may replace parameters with new objects, which would untie the output from the embedding.
    if model.cfg.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight
    with torch.no_grad():
        model.init_buffers()
        if weights != "loaded":
            model.init_weights(seed, per_shard=weights == "per_shard")
    return model


def count_params(model: nn.Module) -> int:
    """Unique parameters: a tied embedding counts once."""
    return sum(p.numel() for p in model.parameters())
