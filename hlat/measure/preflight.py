"""`hlat preflight`: burn-in health checks whose measurements are also what the planner needs to know about the
hardware. One process, or every rank under torchrun (gloo on CPU, NCCL on CUDA):

- compute: matmuls at the shapes the model runs (per tensor-parallel degree), causal attention (SDPA) at the
  sequence length, the memory-bound operations (norm, activation, rotary, residual, loss) as GB/s, whole blocks
  of the real model as the trainer runs them, and the trainer's update (clipping and its optimizer);
- communication: all-reduce, all-gather and reduce-scatter bus bandwidth over a sweep of sizes (as nccl-tests
  report it), send/recv between every pair of neighbouring ranks, and how much of a collective hides behind
  concurrent compute;
- health: bit-identical results on every rank for the same inputs, memory allocatable up to a fraction, and a
  straggler score per rank (its compute time, or its lateness to collectives, against the median rank).

Shapes and nominal byte counts come from `hlat.planner.costs`, so the profile written with `--out` prices exactly
what was measured. Two debug knobs make the health checks testable: one delays a rank's collectives, one perturbs
a rank's numerics."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hlat.models import build_model, materialize
from hlat.models.config import ModelConfig
from hlat.models.layers import apply_rope, document_mask, rope_table
from hlat.models.loss import cross_entropy
from hlat.optim import OptimConfig, build_optimizer
from hlat.optim.modes import MODES
from hlat.optim.precision import autocast, prepare_model
from hlat.parallel.recompute import apply_recomputation
from hlat.parallel.data import apply_data_parallel, sync_gradients
from hlat.parallel.device import backend_for, pick_device
from hlat.parallel.grads import clip_grad_norm
from hlat.parallel.tensor import apply_tensor_parallel
from hlat.planner.costs import (attention_flops, block_shape, dp_block_shape, layer_matmuls, loss_bytes,
                                matmul_flops, memory_op_bytes, optimizer_bytes, output_matmul)
from hlat.planner.profiles import HardwareProfile, Measured

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
BLOCKS_TIMED = 4  # distinct blocks in a row per whole-block timing (fewer when the model has fewer)
DATA_PARALLEL = ("fsdp", "zero1", "ddp")  # arrangements blocks can be timed under (`Layout.sharding`'s names)


@dataclass
class Options:
    model: ModelConfig
    seq_len: int
    micro_batch: int
    tps: tuple[int, ...] = (1,)  # tensor-parallel degrees whose matmul shapes are measured
    other_micro_batches: tuple[int, ...] = ()  # the matmul shapes of these micro-batches are measured too
    dtypes: tuple[str, ...] = ("fp32",)
    sizes: tuple[int, ...] = tuple(2 ** k for k in range(12, 25, 3))  # bytes per device: 4 KiB to 16 MiB
    repeats: int = 5
    threshold: float = 0.8  # a device or link below this share of the median (or of the profile) fails
    memory_fraction: float = 0.9
    delay_rank: int = -1  # debug: this rank sleeps delay_ms before every collective
    delay_ms: float = 0.0
    perturb_rank: int = -1  # debug: this rank's numerics check sees different inputs
    # the trainer's settings a whole block is timed under (`measure_blocks`)
    data_parallel: tuple[str, ...] = ()  # of DATA_PARALLEL: timed again under each, where ranks are left over
    precision: str = "fp32"
    sequence_parallel: bool = True
    recompute: str = "none"
    optim: OptimConfig = field(default_factory=OptimConfig)  # the update timed after the blocks (`measure_update`)
    device: str = "auto"  # train.device


@dataclass
class Report:
    ranks: int
    hosts: list[str]
    device: str
    compute: list[dict] = field(default_factory=list)  # rank 0's measurements
    collectives: list[dict] = field(default_factory=list)
    links: list[dict] = field(default_factory=list)
    overlap: float = -1.0
    memory: dict = field(default_factory=dict)
    stragglers: list[dict] = field(default_factory=list)  # per rank: compute and wait seconds, score
    mismatched: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    measured: Measured = field(default_factory=Measured)


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of fn() after one warm-up call: the least disturbed, on a host
    whose cores other work shares."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def measure_compute(o: Options, device: torch.device) -> tuple[list[dict], dict]:
    """Rows of what was timed, and the Measured fields they give."""
    rows, fields_ = [], {}
    m = o.model
    for dtype_name in o.dtypes:
        dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
        rates: dict[float, float] = {}
        for tokens, tp in ((o.seq_len * mb, tp) for mb in sorted({o.micro_batch, *o.other_micro_batches})
                           for tp in o.tps):
            shapes = {**layer_matmuls(m, tokens, tp), "output": output_matmul(m, tokens, tp)}
            for name, (rows_, inner, cols) in shapes.items():
                a = torch.randn(rows_, inner, device=device, dtype=dtype)
                b = torch.randn(inner, cols, device=device, dtype=dtype)
                seconds = timed(lambda: a @ b, device, o.repeats)
                flops = matmul_flops((rows_, inner, cols))
                rates[flops] = flops / seconds / 1e12
                rows.append({"what": f"matmul {name} tp{tp} {dtype_name}", "shape": f"{rows_}x{inner}x{cols}",
                             "seconds": seconds, "rate": f"{rates[flops]:.3g} TFLOP/s"})
        fields_[f"matmul_{dtype_name}"] = sorted([k, v] for k, v in rates.items())
        heads = m.n_heads
        q = torch.randn(o.micro_batch, heads, o.seq_len, m.head_dim, device=device, dtype=dtype, requires_grad=True)
        kv = torch.randn(o.micro_batch, heads, o.seq_len, m.head_dim, device=device, dtype=dtype, requires_grad=True)

        def attention():
            out = F.scaled_dot_product_attention(q, kv, kv, is_causal=True)
            out.backward(torch.ones_like(out))

        seconds = timed(attention, device, o.repeats)
        rate = attention_flops(m, o.micro_batch, o.seq_len, 1) / seconds / 1e12
        fields_[f"attention_{dtype_name}"] = [[o.seq_len, rate]]
        rows.append({"what": f"attention (SDPA causal, fwd+bwd) {dtype_name}",
                     "shape": f"{o.micro_batch}x{heads}x{o.seq_len}x{m.head_dim}", "seconds": seconds,
                     "rate": f"{rate:.3g} TFLOP/s"})
    rows_, bandwidths = measure_memory_bound(o, device)
    return rows + rows_, {**fields_, **bandwidths}


def measure_blocks(o: Options, device: torch.device, world: int) -> tuple[list[dict], dict]:
    """Whole blocks of the real model, forward + backward, and the rest of a micro-batch (embedding, final
    norm, output layer and loss), run as the trainer runs them (`build_timed_model`), for each tensor-parallel
    degree that divides the ranks (over groups of neighbouring ranks, as the trainer's mesh puts tp innermost) and
    each micro-batch. Recorded under `hlat.planner.costs.block_shape`, which the planner matches exactly. After
    the first of these, the trainer's update over the same parameters (`measure_update`).

    With ranks left over by tensor parallelism (dp = world / tp > 1), the same again under each data-parallel
    arrangement of `o.data_parallel`, wrapped in `fully_shard` by the trainer's own code over those ranks: as the
    last micro-batch of a step runs (gradients reduced) and, for ZeRO-1 and DDP, as the others run (gradients
    accumulated, no reduction). Recorded under `hlat.planner.costs.dp_block_shape`; their excess over the plain
    timing is what the layout's data parallelism costs on this hardware, copies and contention included."""
    m, rows, out, update = o.model, [], {"block_shapes": [], "block_s": [], "ends_s": [], "embedding_s": []}, {}
    for tp in (tp for tp in o.tps if world % tp == 0):
        sp = o.sequence_parallel and tp > 1
        for arrangement in (None, *(o.data_parallel if world > tp else ())):
            mesh = block_mesh(device, world, tp, arrangement)
            for mb in sorted({o.micro_batch, *o.other_micro_batches}):
                shape = block_shape(m, o.seq_len, mb, o.precision, tp, sp, o.recompute)
                timed_model = build_timed_model(o, device, mesh, sp, mb, arrangement)
                layout = f"tp{tp}{' sp' if sp else ''} ac:{o.recompute} {o.precision}"
                if arrangement is None:
                    times = time_steps(timed_model, (block_step, ends_step, embedding_step), world, o.repeats)
                    record_block(out, rows, shape, layout, f"{mb}x{o.seq_len}", times)
                    if not update:  # the first plain timing: its gradients are a backward's, as the update finds them
                        update = measure_update(o, timed_model, world, rows)
                    continue
                for accumulate in (False,) if arrangement == "fsdp" else (False, True):
                    timed_model.sync(accumulate)
                    times = time_steps(timed_model, (block_step, ends_step), world, o.repeats)
                    dp_shape = dp_block_shape(shape, arrangement, world // tp, accumulate)
                    record_block(out, rows, dp_shape, f"{layout} {dp_shape.split(' | ')[-1]}", f"{mb}x{o.seq_len}",
                                 (*times, 0.0))
            settle(mesh)
    return rows, {**out, **update}


def record_block(out: dict, rows: list[dict], shape: str, layout: str, size: str,
                 times: tuple[float, float, float]) -> None:
    """Add one timing of a block, the ends and the embedding (0: not timed) to the profile's fields and the
    report's rows."""
    for key, value in zip(("block_shapes", "block_s", "ends_s", "embedding_s"), (shape, *times)):
        out[key].append(value)
    rows.append({"what": f"block (fwd+bwd) {layout}", "shape": size, "seconds": times[0], "rate": ""})
    rows.append({"what": f"embedding, output layer, loss (fwd+bwd) {layout}", "shape": size, "seconds": times[1],
                 "rate": ""})
    if times[2]:
        rows.append({"what": f"of which the embedding (fwd+bwd) {layout}", "shape": size, "seconds": times[2],
                     "rate": ""})


def measure_update(o: Options, t: TimedModel, world: int, rows: list[dict]) -> dict:
    """The end of the trainer's step over the timed blocks' and the rest's parameters, with the gradients their
    backward left: global gradient-norm clipping, then the trainer's optimizer for the precision mode
    (`build_optimizer`: fused AdamW on CUDA, foreach on the CPU, BF16AdamW in the pure-bf16 modes). As GB/s of
    the mode's nominal AdamW bytes (`hlat.planner.costs.optimizer_bytes`), the figure the planner prices a
    device's parameters at. Taken over a few blocks' worth of tensors, not one: on the 2-core CPU host a lone
    layer-sized tensor's fastest AdamW step ran at 15 GB/s, five times its median, where the trainer's update
    over the whole `small` model ran at 6-7."""
    parts = nn.ModuleList([t.blocks, t.rest])
    params = [p for p in parts.parameters() if p.grad is not None]
    optimizer = build_optimizer(parts, o.optim, o.precision)
    seconds = max(_gather(timed(lambda: update_step(params, optimizer, o.optim.clip_grad_norm), t.device,
                                o.repeats), world))
    n = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    mode = MODES[o.precision]
    gbs = optimizer_bytes(n, mode.weight_bytes, mode.grad_bytes, mode.optimizer_bytes) / seconds / 1e9
    rows.append({"what": f"update (clip, {type(optimizer).__name__}) {o.precision}", "shape": f"{n} params",
                 "seconds": seconds, "rate": f"{gbs:.3g} GB/s"})
    return {"optimizer_gbs": gbs}


def update_step(params: list[nn.Parameter], optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    clip_grad_norm(params, max_norm)
    optimizer.step()


def block_mesh(device: torch.device, world: int, tp: int, arrangement: str | None):
    """The trainer's mesh dimensions (dp_replicate, dp_shard, tp), tp innermost, for timing blocks at `tp` under
    `arrangement` (None: no data parallelism; the other ranks time the same blocks at once, as replicas would):
    FSDP and ZeRO-1 shard over the ranks tp leaves, DDP replicates over them. None for one process without tp."""
    from torch.distributed.device_mesh import init_device_mesh

    if tp == 1 and arrangement is None:
        return None
    dp = world // tp
    shape = (1, dp, tp) if arrangement in ("fsdp", "zero1") else (dp, 1, tp)
    return init_device_mesh(device.type, shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))


def settle(mesh) -> None:
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

    def sync(self, accumulate: bool) -> None:
        """Run the next micro-batches as a step's last (gradients reduced) or as the others (accumulated)."""
        for unit in (self.blocks, self.rest):
            sync_gradients(unit, self.sharded_grads, last_micro_batch=not accumulate)


def build_timed_model(o: Options, device: torch.device, mesh, sp: bool, mb: int,
                      arrangement: str | None) -> TimedModel:
    """Blocks and the rest, built and wrapped by the trainer's own code: the precision mode's parameters, tensor
    (and sequence) parallelism over the mesh's tp ranks, the recomputation mode, and under a data-parallel
    `arrangement` `fully_shard` over its dp ranks.

    A few distinct blocks in a row, as the model runs them: one block timed again and again would find its
    weights and gradients still in the cache, which a whole model (on a CPU host) does not."""
    m = o.model
    stack = min(m.n_layers, BLOCKS_TIMED)
    model = prepare_model(build_model(replace(m, n_layers=stack)), o.precision)
    tp = mesh["tp"].size() if mesh is not None else 1
    if tp > 1:
        apply_tensor_parallel(model, mesh["tp"], sp)
    apply_recomputation(model, o.recompute)
    materialize(model, device)
    blocks = BlockStack([model.layers.pop(str(i)) for i in range(stack)])  # what is left: the rest
    if arrangement is not None:
        for unit in (blocks, model):
            apply_data_parallel(unit, mesh["dp_replicate", "dp_shard"], arrangement == "zero1", pipelined=False)
    x = torch.randn(mb, o.seq_len // tp if sp else o.seq_len, m.dim, device=device,
                    dtype=next(model.parameters()).dtype, requires_grad=True)
    tokens = torch.randint(m.vocab_size, (mb, o.seq_len), device=device)
    # one document per sequence: the trainer's masked attention kernel, where the model masks documents
    doc_ids = torch.zeros_like(tokens) if m.doc_mask else None
    return TimedModel(blocks, model, x, tokens, doc_ids, document_mask(doc_ids) if m.doc_mask else None,
                      o.precision, device, tp, sharded_grads=arrangement == "fsdp")


def block_step(t: TimedModel) -> None:
    with autocast(t.precision, t.device):
        y = t.blocks(t.x, t.rest.rope, t.mask)
    y.backward(torch.ones_like(y))


def ends_step(t: TimedModel) -> None:
    with loss_parallel() if t.tp > 1 else contextlib.nullcontext():
        with autocast(t.precision, t.device):
            logits = t.rest(t.tokens, doc_ids=t.doc_ids)
        cross_entropy(logits, t.tokens).backward()


def embedding_step(t: TimedModel) -> None:
    with autocast(t.precision, t.device):
        h = t.rest.tok_embeddings(t.tokens)
    h.backward(torch.ones_like(h))


def time_steps(t: TimedModel, steps, world: int, repeats: int) -> list[float]:
    """Seconds of each step: per block for `block_step` (the stack's time over its blocks), whole for the others.
    Every rank runs at once, as in training. The statistic is each rank's fastest repeat (as for every preflight
    figure: on a shared host the least disturbed run is the one that reproduces), and of those the slowest
    rank's, since the trainer's collectives wait for it."""
    times = []
    for step in steps:
        step(t)  # a first call allocates the gradients (and timed() warms up once more)
        if world > 1:
            dist.barrier()
        seconds = max(_gather(timed(lambda: step(t), t.device, repeats), world))
        times.append(seconds / len(t.blocks.layers) if step is block_step else seconds)
    return times


def measure_memory_bound(o: Options, device: torch.device) -> tuple[list[dict], dict]:
    """GB/s of each memory-bound operation, fwd + bwd, at one layer's shapes (in the compute dtype of the first
    --dtype), against the nominal bytes of `hlat.planner.costs`."""
    m, tokens = o.model, o.seq_len * o.micro_batch
    dtype = torch.float32 if o.dtypes[0] == "fp32" else torch.bfloat16
    cb = 4 if dtype == torch.float32 else 2
    nominal = memory_op_bytes(m, tokens, 1, False, cb)
    x = torch.randn(o.micro_batch, o.seq_len, m.dim, device=device, dtype=dtype, requires_grad=True)
    gate = torch.randn(o.micro_batch, o.seq_len, m.ffn_dim, device=device, dtype=dtype, requires_grad=True)
    up = torch.randn_like(gate, requires_grad=True)
    qk = torch.randn(o.micro_batch, o.seq_len, m.n_heads + m.kv_heads, m.head_dim, device=device, dtype=dtype,
                     requires_grad=True)
    rope = rope_table(m, device)[: o.seq_len]
    weight = torch.ones(m.dim, device=device, dtype=dtype)

    def backward(y):
        y.backward(torch.ones_like(y))

    def activation():
        return F.silu(gate) * up if m.family == "llama" else F.gelu(gate)

    ops = {"norm": lambda: [backward(F.rms_norm(x, (m.dim,), weight)) for _ in range(2)],
           "activation": lambda: backward(activation()),
           "rotary": lambda: backward(apply_rope(qk, rope)),
           "residual": lambda: [backward(x + x) for _ in range(2)]}
    rows, out = [], {}
    for op, fn in ops.items():
        seconds = timed(fn, device, o.repeats)
        out[f"{op}_gbs"] = nominal[op] / seconds / 1e9
        rows.append({"what": f"{op} (fwd+bwd)", "shape": f"{tokens} tokens", "seconds": seconds,
                     "rate": f"{out[f'{op}_gbs']:.3g} GB/s"})
    logits = torch.randn(tokens, m.vocab_size, device=device, requires_grad=True)
    targets = torch.randint(m.vocab_size, (tokens,), device=device)
    seconds = timed(lambda: F.cross_entropy(logits, targets).backward(), device, o.repeats)
    out["loss_gbs"] = loss_bytes(m, tokens, 1) / seconds / 1e9
    rows.append({"what": "loss (cross-entropy, fwd+bwd)", "shape": f"{tokens}x{m.vocab_size}", "seconds": seconds,
                 "rate": f"{out['loss_gbs']:.3g} GB/s"})
    n = m.layer_params()
    # fully_shard's gathers and reductions copy a unit into (or out of) a freshly allocated flat buffer
    unit = torch.randn(n, device=device)
    seconds = timed(lambda: torch.empty_like(unit).copy_(unit), device, o.repeats)
    out["copy_gbs"] = 2 * 4 * n / seconds / 1e9
    rows.append({"what": "copy into a new buffer (fully_shard)", "shape": f"{n} fp32", "seconds": seconds,
                 "rate": f"{out['copy_gbs']:.3g} GB/s"})
    return rows, out


def numerics_digest(o: Options, device: torch.device, rank: int) -> float:
    """A matmul of seeded inputs, summed in float64: the same on every healthy rank of one hardware type."""
    g = torch.Generator(device="cpu").manual_seed(1234)
    a = torch.randn(256, 256, generator=g).to(device)
    if rank == o.perturb_rank:
        a[0, 0] += 1e-3
    return float((a @ a.T).double().sum().item())


def _delay(o: Options, rank: int) -> None:
    if rank == o.delay_rank and o.delay_ms > 0:
        time.sleep(o.delay_ms / 1e3)


def measure_collectives(o: Options, device: torch.device, rank: int, world: int) -> tuple[list[dict], float]:
    """Bus bandwidth of each collective at each size (nccl-tests' busbw: algbw x 2(n-1)/n for all-reduce,
    x (n-1)/n for all-gather and reduce-scatter), and the seconds this rank spent before entering them (its
    delays: where a straggler shows), and the seconds the timed collectives took in all (the late rank's delay
    included: every rank waits for it)."""
    rows, local, total = [], 0.0, 0.0
    for op in COLLECTIVES:
        for size in o.sizes:
            numel = max(world, size // 4 // world * world)
            buf = torch.ones(numel, device=device)
            shard = torch.empty(numel // world, device=device)
            times = []
            for i in range(o.repeats + 1):
                dist.barrier()
                start = time.perf_counter()
                _delay(o, rank)
                local += time.perf_counter() - start
                if op == "all_reduce":
                    dist.all_reduce(buf)
                elif op == "all_gather":
                    dist.all_gather_single(buf, shard)
                else:
                    dist.reduce_scatter_single(shard, buf)
                _sync(device)
                if i:
                    times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            total += sum(times)
            factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
            nbytes = numel * 4
            rows.append({"op": op, "bytes": nbytes, "seconds": seconds, "algbw_gbs": nbytes / seconds / 1e9,
                         "busbw_gbs": nbytes / seconds / 1e9 * factor})
    return rows, local, total


def bulk_size(o: Options) -> int:
    """Bytes of the link and overlap checks: the largest size up to 16 MiB, about one block's gradients (the
    sweep may reach a 200 MB embedding; a message that long would measure how much of the overlap check's
    matmul hides behind it, not the reverse)."""
    return min(max(o.sizes), 2 ** 24)


def measure_links(o: Options, device: torch.device, rank: int, world: int, hosts: list[str]) -> list[dict]:
    """Send/recv between each rank and the next (ring order), one pair at a time, at `bulk_size`."""
    numel = bulk_size(o) // 4
    buf = torch.ones(numel, device=device)
    rows = []
    for src in range(world):
        dst = (src + 1) % world
        times = []
        for i in range(o.repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            if rank == src:
                _delay(o, rank)
                dist.send(buf, dst)
                dist.recv(buf[:1], dst)  # the receiver's acknowledgement: the transfer has landed
            elif rank == dst:
                _delay(o, rank)
                dist.recv(buf, src)
                dist.send(buf[:1], src)
            _sync(device)
            if i:
                times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        rows.append({"src": src, "dst": dst, "hosts": f"{hosts[src]} -> {hosts[dst]}", "bytes": numel * 4,
                     "seconds": seconds, "gbs": numel * 4 / seconds / 1e9})
    # only the pair's two ranks timed the transfer: take the sender's figure
    times = [None] * world
    dist.all_gather_object(times, [r["seconds"] for r in rows])
    for r in rows:
        r["seconds"] = times[r["src"]][r["src"]]
        r["gbs"] = r["bytes"] / r["seconds"] / 1e9
    return rows


def measure_overlap(o: Options, device: torch.device) -> float:
    """Share of an all-reduce hidden behind a concurrent matmul: (t_matmul + t_allreduce - t_both) over the
    shorter of the two, clamped to [0, 1]. The all-reduce runs on the communication stream while the compute
    stream goes on, as `fully_shard` issues the trainer's. On the CPU it is 0 without measuring: there gloo's
    collectives, as fully_shard issues them, block the thread that issued them, so nothing hides (a timing would
    only measure the host's noise)."""
    if device.type == "cpu":
        return 0.0
    n = 512
    a = torch.randn(n, n, device=device)
    buf = torch.ones(bulk_size(o) // 4, device=device)

    def matmul():
        for _ in range(4):
            a @ a

    def reduce():
        dist.all_reduce(buf)

    def both():
        work = dist.all_reduce(buf, async_op=True)
        matmul()
        work.wait()

    t_mm, t_ar = timed(matmul, device, o.repeats), timed(reduce, device, o.repeats)
    t_both = timed(both, device, o.repeats)
    return min(1.0, max(0.0, (t_mm + t_ar - t_both) / min(t_mm, t_ar)))


def check_memory(o: Options, device: torch.device) -> dict:
    """Allocate memory_fraction of the device's free memory, in 1 GiB pieces (accelerators only)."""
    if device.type == "cpu":
        return {"checked": False, "note": "host memory: not checked"}
    free, total = torch.accelerator.get_memory_info(device) if hasattr(torch.accelerator, "get_memory_info") \
        else torch.cuda.mem_get_info(device)
    want, pieces = int(free * o.memory_fraction), []
    try:
        while sum(p.numel() for p in pieces) < want:
            pieces.append(torch.empty(min(2 ** 30, want - sum(p.numel() for p in pieces)), dtype=torch.uint8,
                                      device=device))
        return {"checked": True, "allocated_gib": want / 2 ** 30, "total_gib": total / 2 ** 30}
    except torch.OutOfMemoryError:
        got = sum(p.numel() for p in pieces)
        return {"checked": True, "failed": True, "allocated_gib": got / 2 ** 30, "wanted_gib": want / 2 ** 30}
    finally:
        del pieces


def run_preflight(o: Options) -> Report:
    device = pick_device(o.device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    started_here = world > 1 and not dist.is_initialized()
    if started_here:
        dist.init_process_group(backend_for(device), timeout=timedelta(minutes=5),
                                device_id=None if device.type == "cpu" else device)
    rank = dist.get_rank() if world > 1 else 0
    try:
        return _run(o, device, rank, world)
    finally:
        if started_here:
            dist.destroy_process_group()


def _gather(value, world: int) -> list:
    if world == 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def _run(o: Options, device: torch.device, rank: int, world: int) -> Report:
    hosts = _gather(socket.gethostname(), world)
    report = Report(ranks=world, hosts=hosts, device=str(device))
    start = time.perf_counter()
    compute, fields_ = measure_compute(o, device)
    computed = time.perf_counter() - start
    blocks, block_fields = measure_blocks(o, device, world)
    compute += blocks
    fields_.update(block_fields)
    waited = collective_s = 0.0
    measured = Measured(**fields_)
    if world > 1:
        collectives, waited, collective_s = measure_collectives(o, device, rank, world)
        report.collectives = collectives
        report.links = measure_links(o, device, rank, world, hosts)
        report.overlap = measure_overlap(o, device)
        for op in COLLECTIVES:
            setattr(measured, op, [[r["bytes"], r["busbw_gbs"]] for r in collectives if r["op"] == op])
        measured.send_recv = [[statistics.median(r["bytes"] for r in report.links),
                               statistics.median(r["gbs"] for r in report.links)]]
        measured.overlap = round(_gather(report.overlap, world)[0], 3)
    report.compute = compute
    report.memory = check_memory(o, device)

    digests = _gather(numerics_digest(o, device, rank), world)
    majority = statistics.mode(digests)
    report.mismatched = [r for r, d in enumerate(digests) if d != majority]
    report.stragglers = straggler_scores(_gather((computed, waited, collective_s), world), hosts)
    report.problems = problems(report, o)
    measured.source = (f"hlat preflight, {world} rank(s) on {', '.join(sorted(set(hosts)))} ({device.type}), "
                       f"{o.model.preset or o.model.family} seq {o.seq_len} micro-batch {o.micro_batch}")
    report.measured = _rounded(measured)
    return report


def straggler_scores(timings: list[tuple[float, float, float]], hosts: list[str]) -> list[dict]:
    """Per rank, how much it slows the job, as a factor (1 = the median rank): the larger of its compute time over
    the median rank's, and how much longer the collectives take for its lateness in entering them (its wait
    beyond the median rank's, over the collectives' median total time). The two are scored apart because on a
    shared or loaded host compute times vary by more than a rank's lateness to the collectives adds to them."""
    compute = statistics.median(t[0] for t in timings)
    wait = statistics.median(t[1] for t in timings)
    collective = statistics.median(t[2] for t in timings)
    return [{"rank": r, "host": hosts[r], "compute_s": c, "wait_s": w,
             "score": max(c / compute if compute else 1.0, 1 + (w - wait) / collective if collective else 1.0)}
            for r, (c, w, _) in enumerate(timings)]


def _rounded(measured: Measured) -> Measured:
    """Four significant digits: more than any measurement here resolves, and a readable profile."""
    def r(x):
        return [r(v) for v in x] if isinstance(x, list) else float(f"{x:.4g}") if isinstance(x, float) else x

    return Measured(**{k: r(v) for k, v in asdict(measured).items()})


def problems(report: Report, o: Options) -> list[str]:
    """One line per device or link below the threshold, naming rank and host."""
    out = [f"rank {r} ({report.hosts[r]}): numerics differ from the other ranks for the same inputs"
           for r in report.mismatched]
    out += [f"rank {s['rank']} ({s['host']}): straggler, {s['score']:.2f}x the median rank's time"
            for s in report.stragglers if s["score"] > 1 / o.threshold]
    if report.links:
        median = statistics.median(r["gbs"] for r in report.links)
        out += [f"link rank {r['src']} -> rank {r['dst']} ({r['hosts']}): {r['gbs']:.3g} GB/s, "
                f"{r['gbs'] / median:.0%} of the median link" for r in report.links if r["gbs"] < o.threshold * median]
    if report.memory.get("failed"):
        out.append(f"rank 0 ({report.hosts[0]}): could allocate only {report.memory['allocated_gib']:.1f} of "
                   f"{report.memory['wanted_gib']:.1f} GiB")
    return out


def measured_profile(report: Report, base: HardwareProfile, local_ranks: int) -> HardwareProfile:
    """`base` (public figures) with the measurements, for `hlat plan --hardware measured.toml`. On a CPU host
    each process is a device: a node holds the ranks preflight ran there."""
    per_node = local_ranks if report.device.startswith("cpu") else base.devices_per_node
    return replace(base, name=f"{base.name}-measured", measured=report.measured, devices_per_node=per_node,
                   description=f"{base.description}; measured by hlat preflight")


def report_json(report: Report) -> str:
    return json.dumps(asdict(report), indent=2, default=str)
