"""Context parallelism: every sequence split over the cp ranks of the mesh (docs/long-context.md).

Causal attention costs more at a sequence's end (a query attends every key before it), so the sequence is cut
into 2 x cp equal chunks and rank i holds chunks i and 2cp-1-i: every rank then does the same attention work (Llama
3's load balancing). All cp ranks read the same micro-batches (they share a data-parallel rank) and each keeps its
chunks with their tokens' true positions, which rotary embeddings and the mask read; the model gathers every
rank's keys and values in attention (`hlat.models.context`). The cp ranks share FSDP's parameter sharding
(`hlat.parallel.mesh`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hlat.models.context import SequenceSplit
from hlat.models.layers import row_positions


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Make `model` (a whole model or a pipeline stage of one) run on its rank's part of each sequence."""
    split = SequenceSplit(cp_mesh)
    model.split = split
    for block in model.layers.values():
        block.attention.split = split
        if model.cfg.moe:  # routing spans whole sequences (hlat.models.moe)
            block.feed_forward.cp = split


def split_batch(batch: dict[str, torch.Tensor], cp: int, rank: int) -> dict[str, torch.Tensor]:
    """Context-parallel rank `rank`'s part of a micro-batch of whole sequences: chunks rank and 2cp-1-rank of
    each tensor's sequence dimension, "positions" included (the tokens' places in their rows when the batch
    has none: packed documents bring their own)."""
    if cp == 1:
        return batch
    batch = {"positions": row_positions(batch["inputs"]), **batch}
    return {key: own_chunks(t, cp, rank) for key, t in batch.items()}


def own_chunks(t: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Chunks `rank` and 2cp-1-`rank` of the 2 x cp along dimension 1, in that order."""
    chunks = t.chunk(2 * cp, dim=1)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=1)
