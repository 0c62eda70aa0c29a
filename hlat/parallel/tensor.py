"""Tensor parallelism (Megatron-style) with sequence parallelism in the norm regions, applied from outside.

Attention and MLP input projections are column-parallel and output projections row-parallel, so each block
needs one all-gather and one reduce-scatter (sequence parallel) or one all-reduce. The embedding is
vocabulary-parallel, and the output projection keeps the logits sharded over the vocabulary: the loss is
computed under `loss_parallel()`, so full logits are never gathered.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard `model` (a whole model or a pipeline stage of one) over `tp_mesh` in place."""
    between = Shard(1) if sequence_parallel else Replicate()  # layout of activations between blocks
    top: dict = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, tp_mesh, top)

    for block in model.layers.values():
        plan = {
            "attention": PrepareModuleInput(input_layouts=(between, None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=between),
            "feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=between),
        }
        if hasattr(block.feed_forward, "w3"):  # SwiGLU's second input projection
            plan["feed_forward.w3"] = ColwiseParallel()
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
    if model.cfg.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight  # both shard the vocabulary dimension: re-tie
