"""Tensor parallelism (Megatron-style) with sequence parallelism in the norm regions, applied from outside.

Attention and MLP input projections are column-parallel and output projections row-parallel, so each block
needs one all-gather and one reduce-scatter (sequence parallel) or one all-reduce. The embedding is
vocabulary-parallel, and so is the loss: the chunked loss (hlat.models.loss.linear_cross_entropy) takes the
output weight's local rows, and with `model.loss_chunk = 0` the output projection keeps the logits sharded over
the vocabulary for a loss under `loss_parallel()`; full logits are never gathered.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hlat.models.context import SequenceSplit
from hlat.parallel.experts import split_experts


def replicate_kv_heads(projection: nn.Linear, tp_mesh: DeviceMesh, kv_heads: int, head_dim: int) -> None:
    """More tensor-parallel ranks than kv heads (HLAT's 70B: 8 kv heads, TP 32): every rank keeps the whole
    k or v projection and computes all kv heads, then keeps the one its query heads use (rank r of tp serves
    query heads whose kv head is r // (tp / kv_heads)). Gradients from the ranks sharing a head are summed:
    the output's gradient is declared Partial, so the replicated weight's gradient is all-reduced."""
    tp = tp_mesh.size()
    head = tp_mesh.get_local_rank() // (tp // kv_heads)
    cols = slice(head * head_dim, (head + 1) * head_dim)

    def replicate(name, module, mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))

    def own_head(module, output, mesh):
        return output.to_local(grad_placements=[Partial()])[..., cols]

    distribute_module(projection, tp_mesh, replicate, output_fn=own_head)


def mlp_plan(between) -> dict:
    return {
        "feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=between),
    }


def experts_plan(block: nn.Module, tp_mesh: DeviceMesh, between) -> dict:
    """A mixture-of-experts layer under tensor parallelism (hlat.models.moe): each rank routes its shard of the
    sequences (the router's weight replicated, its gradient summed over the ranks as a norm's under sequence
    parallelism), then every rank runs every shard's tokens through its slice of each expert's ffn_dim
    (`hlat.parallel.experts`, which splits them over ep and tp where there is expert parallelism), and the partial
    outputs are summed back into `between`."""
    moe = block.feed_forward
    moe.tp = SequenceSplit(tp_mesh)
    if not isinstance(moe.experts.w1, DTensor):
        split_experts(moe.experts, tp_mesh)
    return {
        "feed_forward": PrepareModuleInputOutput(
            input_layouts=(between,),
            desired_input_layouts=(Shard(1),),
            use_local_input=True,
            output_layouts=(Partial(),),
            desired_output_layouts=(between,),
        ),
        "feed_forward.router": SequenceParallel(use_local_output=True),
    }


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
            "attention": PrepareModuleInput(
                input_layouts=(between, None, None),  # (x, rope, document mask)
                desired_input_layouts=(Replicate(), None, None),
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=between),
            **(experts_plan(block, tp_mesh, between) if model.cfg.moe else mlp_plan(between)),
        }
        kv_heads = model.cfg.kv_heads
        if kv_heads % tp_mesh.size() == 0:
            plan["attention.wk"] = plan["attention.wv"] = ColwiseParallel()
        else:
            for projection in (block.attention.wk, block.attention.wv):
                replicate_kv_heads(projection, tp_mesh, kv_heads, model.cfg.head_dim)
        if hasattr(block.feed_forward, "w3"):  # SwiGLU's second input projection
            plan["feed_forward.w3"] = ColwiseParallel()
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
    if model.cfg.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight  # both shard the vocabulary dimension: re-tie
