"""A few blocks of the real model and the rest of it, built, wrapped and run as the trainer runs them, for
`hlat.measure.blocks` to time: the trainer's mesh, the precision mode's parameters and autocast, tensor (and
sequence) parallelism, recomputation, compiled blocks, and `fully_shard` data parallelism."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from hlat.measure.options import Options
from hlat.measure.timing import timed_on_every_rank
from hlat.models import build_model, materialize
from hlat.models.layers import document_mask
from hlat.optim.precision import autocast, prepare_model
from hlat.parallel import compile_blocks
from hlat.parallel.config import ParallelConfig
from hlat.parallel.data import apply_data_parallel, sync_gradients
from hlat.parallel.mesh import data_parallel_dims
from hlat.parallel.recompute import apply_recomputation
from hlat.parallel.tensor import apply_tensor_parallel

BLOCKS_TIMED = 4  # distinct blocks in a row per whole-block timing (fewer when the model has fewer)


def block_mesh(device: torch.device, world: int, tp: int, arrangement: str | None) -> DeviceMesh | None:
    """The trainer's mesh dimensions (dp_replicate, dp_shard, tp), tp innermost, for timing blocks at `tp` under
    `arrangement` (None: no data parallelism; the other ranks time the same blocks at once, as replicas would):
    FSDP and ZeRO-1 shard over the ranks tp leaves, DDP replicates over them. None for one process without tp."""
    if tp == 1 and arrangement is None:
        return None
    dp = world // tp
    shape = (1, dp, tp) if arrangement in ("fsdp", "zero1") else (dp, 1, tp)
    return init_device_mesh(device.type, shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))


def settle(mesh: DeviceMesh | None) -> None:
    """Wait until no collective is in flight on the mesh's groups. The timed steps leave some nobody waits for
    (tensor-parallel gradients no optimizer reads); a gloo barrier completes after all earlier work on its group,
    so none is left when the process exits (a gloo thread still holding one aborted the process at exit under
    load)."""
    if mesh is not None:
        for name in mesh.mesh_dim_names:
            dist.barrier(group=mesh.get_group(name))


class BlockStack(nn.Module):
    """Blocks called one after another as the model calls its layers; under data parallelism a `fully_shard`
    root of their own, each block a unit as in the trainer (`apply_data_parallel` wraps `layers`, then this)."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x, rope, mask)
        return x


@dataclass
class TimedModel:
    """A few distinct blocks of the real model and the rest of it (embedding, final norm, output layer), with one
    micro-batch of inputs: a block's input activation, and tokens for the rest."""

    blocks: BlockStack
    rest: nn.Module
    x: torch.Tensor
    tokens: torch.Tensor
    doc_ids: torch.Tensor | None
    mask: torch.Tensor | None
    precision: str
    device: torch.device
    tp: int
    sharded_grads: bool  # FSDP (not ZeRO-1 or DDP): gradients reduce-scattered every micro-batch

    @property
    def micro_batch(self) -> int:
        return self.tokens.shape[0]

    def sync(self, accumulate: bool) -> None:
        """Run the next micro-batches as a step's last (gradients reduced) or as the others (accumulated)."""
        for unit in (self.blocks, self.rest):
            sync_gradients(unit, self.sharded_grads, last_micro_batch=not accumulate)


def build_timed_model(
    options: Options, device: torch.device, mesh: DeviceMesh | None, micro_batch: int, arrangement: str | None
) -> TimedModel:
    """Blocks and the rest, built and wrapped by the trainer's own code: the precision mode's parameters, tensor
    (and sequence) parallelism over the mesh's tp ranks, the recomputation mode, compiled blocks (parallel.compile)
    and under a data-parallel `arrangement` `fully_shard` over its dp ranks.

    A few distinct blocks in a row, as the model runs them: one block timed again and again would find its
    weights and gradients still in the cache, which a whole model (on a CPU host) does not."""
    model_config = options.model
    stack = min(model_config.n_layers, BLOCKS_TIMED)
    model = prepare_model(build_model(replace(model_config, n_layers=stack)), options.precision)
    tp = mesh["tp"].size() if mesh is not None else 1
    sequence_parallel = options.sequence_parallel and tp > 1
    if tp > 1:
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel)
    apply_recomputation(model, options.recompute)
    if options.compiled_blocks(tp):
        compile_blocks(model, ParallelConfig(tp=tp, compile=True, compile_backend=options.compile_backend))
    materialize(model, device)
    blocks = BlockStack([model.layers.pop(str(i)) for i in range(stack)])  # what is left: the rest
    if arrangement is not None:
        for unit in (blocks, model):
            dims = data_parallel_dims(mesh["dp_replicate"].size(), "dp_shard")
            apply_data_parallel(unit, mesh[dims], arrangement == "zero1", pipelined=False)
    x = torch.randn(
        micro_batch,
        options.seq_len // tp if sequence_parallel else options.seq_len,
        model_config.dim,
        device=device,
        dtype=next(model.parameters()).dtype,
        requires_grad=True,
    )
    tokens = torch.randint(model_config.vocab_size, (micro_batch, options.seq_len), device=device)
    # one document per sequence: the trainer's masked attention kernel, where the model masks documents
    doc_ids = torch.zeros_like(tokens) if model_config.doc_mask else None
    return TimedModel(
        blocks,
        model,
        x,
        tokens,
        doc_ids,
        document_mask(doc_ids) if model_config.doc_mask else None,
        options.precision,
        device,
        tp,
        sharded_grads=arrangement == "fsdp",
    )


def block_step(timed_model: TimedModel) -> None:
    with autocast(timed_model.precision, timed_model.device):
        y = timed_model.blocks(timed_model.x, timed_model.rest.rope, timed_model.mask)
    y.backward(torch.ones_like(y))


def ends_step(timed_model: TimedModel) -> None:
    with loss_parallel() if timed_model.tp > 1 else contextlib.nullcontext():
        with autocast(timed_model.precision, timed_model.device):
            loss = timed_model.rest(timed_model.tokens, doc_ids=timed_model.doc_ids, targets=timed_model.tokens)
        loss.backward()


def embedding_step(timed_model: TimedModel) -> None:
    with autocast(timed_model.precision, timed_model.device):
        h = timed_model.rest.tok_embeddings(timed_model.tokens)
    h.backward(torch.ones_like(h))


def time_steps(
    timed_model: TimedModel, steps: Sequence[Callable[[TimedModel], None]], world: int, repeats: int
) -> list[float]:
    """Seconds of each step: per block for `block_step` (the stack's time over its blocks), whole for the others.
    Every rank runs at once, as in training. The statistic is each rank's fastest repeat (as for every preflight
    figure: on a shared host the least disturbed run is the one that reproduces), and of those the slowest
    rank's, since the trainer's collectives wait for it."""
    times = []
    for step in steps:
        step(timed_model)  # a first call allocates the gradients (and timed() warms up once more)
        if world > 1:
            dist.barrier()
        seconds = timed_on_every_rank(partial(step, timed_model), timed_model.device, repeats)
        times.append(seconds / len(timed_model.blocks.layers) if step is block_step else seconds)
    return times
