"""Communication time: tensor- and context-parallel collectives, pipeline sends and data-parallel traffic.

A collective is priced from the best figure the profile has: the bus bandwidth `hlat preflight` measured at that
size within a node; else the bus bandwidth cited from published nccl-tests runs on the instance (`Links`: within
a node, and across nodes at the run's node count); else the nominal link figures (ring bandwidth and per-step
latency) times the profile's fitted `intra_factor` / `inter_factor`.

What the trainer overlaps decides what is charged. Tensor-parallel collectives sit between a layer's matmuls and
are charged in full, and so are context parallelism's gathers of keys and values (attention waits for them).
Pipeline sends are charged per micro-batch (and in the bubble), except under the trainer's interleaved schedule,
which posts its receives early (`sends_overlap`; see `hlat.planner.timing`). FSDP
prefetches the next block's gather and reduce-scatters during backward, every micro-batch; replicated layouts and
ZeRO-1 reduce during the last micro-batch's backward (ZeRO-1 gathers once, during the first forward). The share of that
traffic which hides behind the compute it runs beside is the overlap preflight measured; with cited collectives it is
the whole of it, up to that compute (the trainer issues them on their own stream); with neither, FSDP hides fully and
the rest is priced by the fitted `dp_factor`.
"""

from __future__ import annotations

from hlat.planner.costs import dp_block_shape, interpolate
from hlat.planner.layout import Layout, Workload
from hlat.planner.memory import block_linear_weights, layer_params_per_device, sharded_units
from hlat.profiles import Fit, HardwareProfile, Links


def rate(table: list[list[float]], size: float, unit: float) -> float:
    return interpolate(table, size) * unit


def collective(hw: HardwareProfile, nbytes: float, group: int, per_node: int, passes: int) -> tuple[float, float]:
    """Nominal (intra-node, inter-node) seconds of a hierarchical ring collective over `group` devices, `per_node`
    of them in each node, on `nbytes` per device; `passes` is 2 for an all-reduce, 1 for an all-gather or a
    reduce-scatter. Across nodes every device of a node runs its group's collective at the same time, so the
    node's network bandwidth is shared by devices_per_node / per_node groups."""
    if group <= 1:
        return 0.0, 0.0
    g = min(per_node, group)
    k = group // g
    intra = inter = 0.0
    if g > 1:
        intra = passes * ((g - 1) / g * nbytes / (hw.intra_gbs * 1e9) + (g - 1) * hw.intra_latency_us * 1e-6)
    if k > 1:
        share = hw.inter_gbps / 8 * 1e9 * g / hw.devices_per_node
        inter = passes * ((k - 1) / k * nbytes / share + (k - 1) * hw.inter_latency_us * 1e-6)
    return intra, inter


def cited_busbw(links: Links, op: str, nbytes: float, nodes: int) -> float:
    """The cited bus bandwidth (GB/s) of `op` on `nbytes` within one node, or across `nodes` nodes (interpolated
    in log nodes between the cited node counts, flat beyond them); 0 where nothing is cited."""
    table = links.table(op, nodes > 1)
    if not table:
        return 0.0
    if nodes == 1:
        return interpolate(table, nbytes)
    counts = sorted({row[0] for row in table})
    at_count = [[c, interpolate([row[1:] for row in table if row[0] == c], nbytes)] for c in counts]
    return interpolate(at_count, nodes)


def link_time(hw: HardwareProfile, fit: Fit, op: str, nbytes: float, group: int, per_node: int) -> float:
    """Seconds of a collective (`op`: all_reduce, all_gather or reduce_scatter) on `nbytes` per device over `group`
    devices, `per_node` of them in each node. Across nodes the cited bandwidth was taken with every device of each
    node in the collective; a group with fewer per node has that share of the node's network."""
    if group <= 1:
        return 0.0
    passes = 2 if op == "all_reduce" else 1
    g = min(per_node, group)
    nodes = group // g
    measured = getattr(hw.measured, op)
    if nodes == 1 and measured:
        return passes * (g - 1) / g * nbytes / rate(measured, nbytes, 1e9)
    cited = cited_busbw(hw.links, op, nbytes, nodes)
    if cited:
        share = g / hw.devices_per_node if nodes > 1 else 1.0
        seconds = passes * (group - 1) / group * nbytes / (cited * 1e9 * share)
        return max(seconds, hw.links.inter_latency_us * 1e-6 if nodes > 1 else 0.0)
    intra, inter = collective(hw, nbytes, group, per_node, passes)
    if measured and g > 1:
        intra = passes * (g - 1) / g * nbytes / rate(measured, nbytes, 1e9)
    else:
        intra *= fit.intra_factor
    return intra + inter * fit.inter_factor


def message_bytes(work: Workload, hw: HardwareProfile) -> tuple[float, float]:
    """Bytes per element of a tensor-parallel collective and of a pipeline send: hlat's trainer's (its residual
    stream in the parameters' dtype: `Workload.tp_message_bytes`, `stream_bytes`), or the compute dtype's for a
    Megatron-style stack, which keeps its residual stream in it."""
    if hw.activations == "hlat":
        return work.tp_message_bytes, work.stream_bytes
    return work.compute_bytes, work.compute_bytes


def tensor_parallel_time(work: Workload, layout: Layout, hw: HardwareProfile, fit: Fit) -> float:
    """Seconds of one layer's tensor-parallel collectives for one micro-batch, on the critical path: 4
    all-reduces of the full activation (6 with full recomputation), each an all-gather and a reduce-scatter
    under sequence parallelism; a group larger than a node runs them over the network."""
    if layout.tp == 1:
        return 0.0
    count = 6 if layout.activation_checkpoint == "full" else 4
    nbytes = layout.held(work.seq_len) * layout.micro_batch * work.model.dim * message_bytes(work, hw)[0]
    ops = ("all_gather", "reduce_scatter") if layout.sequence_parallel else ("all_reduce",)
    per_node = min(layout.tp, hw.devices_per_node)
    return count * sum(link_time(hw, fit, op, nbytes, layout.tp, per_node) for op in ops)


def gathered_kv_elements(work: Workload, layout: Layout) -> float:
    """Elements of the keys and values one rank gathers over the cp group for one layer and micro-batch: the
    whole sequence of its kv heads (one when tp exceeds the kv heads)."""
    model = work.model
    heads = model.kv_heads // layout.tp if model.kv_heads % layout.tp == 0 else 1
    return 2 * work.seq_len * layout.micro_batch * heads * model.head_dim


def context_parallel_time(work: Workload, layout: Layout, hw: HardwareProfile, fit: Fit) -> float:
    """Seconds of one layer's context-parallel collectives for one micro-batch, on the critical path (attention
    waits for them): K and V all-gathered in forward (again in backward under full recomputation) and their
    gradients reduce-scattered in backward, in the compute dtype, over the cp ranks. The mesh puts tp innermost and
    cp next: a node holds devices_per_node / tp of a cp group (at least one), and a larger group crosses nodes."""
    if layout.cp == 1:
        return 0.0
    each = gathered_kv_elements(work, layout) / 2 * work.compute_bytes  # K's, then V's
    per_node = max(1, hw.devices_per_node // layout.tp)
    gathers = 2 if layout.activation_checkpoint == "full" else 1
    return 2 * (
        gathers * link_time(hw, fit, "all_gather", each, layout.cp, per_node)
        + link_time(hw, fit, "reduce_scatter", each, layout.cp, per_node)
    )


def expert_parallel_time(work: Workload, layout: Layout, hw: HardwareProfile, fit: Fit) -> float:
    """Seconds of one layer's expert-parallel all-to-alls for one micro-batch, on the critical path (the experts
    wait for their tokens, the block for their outputs): each choice's token sent to its expert's rank and the
    output back, in forward and their gradients in backward (the forward's again under full recomputation), in the
    compute dtype; a rank sends experts_per_token x dim per token it routes and the busiest receives `load` x that.
    The ep ranks are neighbours in the dp_shard x cp block, tp apart (`hlat.parallel.mesh`): a node holds
    devices_per_node / tp of a group, and a larger group crosses nodes (`all_to_all_time`)."""
    if layout.ep == 1:
        return 0.0
    model = work.model
    tokens = layout.held(work.seq_len) * layout.micro_batch
    nbytes = tokens * model.experts_per_token * model.dim * work.compute_bytes * work.load(layout)
    per_node = max(1, hw.devices_per_node // layout.tp)
    count = 6 if layout.activation_checkpoint == "full" else 4
    return count * all_to_all_time(hw, fit, nbytes, layout.ep, per_node)


def all_to_all_time(hw: HardwareProfile, fit: Fit, nbytes: float, group: int, per_node: int) -> float:
    """Seconds of an all-to-all in which each of `group` ranks, `per_node` of them in each node, sends `nbytes` in
    all, an equal share to each: what goes to ranks of its node at the intra-node bandwidth, what goes to other
    nodes at the rank's share of its node's network (every rank of the node sends at once), both at the same time.
    Unlike a ring collective, nothing is combined on the way: a rank's share for other nodes crosses whole."""
    g = min(per_node, group)
    intra = (g - 1) / group * nbytes / (hw.intra_gbs * 1e9) + (g - 1) * hw.intra_latency_us * 1e-6
    nodes = group // g
    rank_network = hw.inter_gbps / 8 * 1e9 / hw.devices_per_node
    inter = (group - g) / group * nbytes / rank_network + (nodes - 1) * hw.inter_latency_us * 1e-6 if nodes > 1 else 0
    return max(intra * fit.intra_factor, inter * fit.inter_factor)


def pipeline_send_time(work: Workload, layout: Layout, hw: HardwareProfile, fit: Fit) -> float:
    """Seconds of one micro-batch's pipeline sends on a stage: its tp shard of the activations forward and of
    their gradients backward, once per model chunk, plus the fitted fixed cost of each."""
    if layout.pp == 1:
        return 0.0
    msg = layout.held(work.seq_len) * layout.micro_batch * work.model.dim * message_bytes(work, hw)[1] / layout.tp
    dpn = hw.devices_per_node
    if layout.tp * layout.dp >= dpn:  # a stage fills whole nodes: every device of a node sends across at once
        one = (msg * dpn / (hw.inter_gbps / 8 * 1e9) + hw.inter_latency_us * 1e-6) * fit.inter_factor
    elif hw.measured.send_recv:
        one = msg / rate(hw.measured.send_recv, msg, 1e9)
    else:
        one = (msg / (hw.intra_gbs * 1e9) + hw.intra_latency_us * 1e-6) * fit.intra_factor
    return 2 * layout.virtual_stages * (one + fit.p2p_ms * 1e-3)


def gathered_bytes(work: Workload, layout: Layout) -> tuple[float, float]:
    """Bytes per parameter `fully_shard` gathers, of each block and of the rest of the stage: the weights as
    stored; with FP8 under tensorwise scaling torchao gathers the blocks' linear weights in FP8, 1 byte each
    (`enable_fsdp_float8_all_gather`), and their biases and norms as stored. Rowwise scaling gathers as stored."""
    stored = work.mode.weight_bytes
    if work.fp8 != "tensorwise":
        return stored, stored
    block, linear = layer_params_per_device(work.model, layout.tp), block_linear_weights(work.model, layout.tp)
    return (linear + (block - linear) * stored) / block, stored


def dp_collective(
    work: Workload,
    layout: Layout,
    hw: HardwareProfile,
    fit: Fit,
    op: str,
    bytes_per_param: tuple[float, float],
    group: int,
    per_node: int,
    blocks: int = 1,
    rest: int = 1,
) -> float:
    """Seconds of the data-parallel collectives `op` over the stage's parameters as the trainer issues them
    (`bytes_per_param` of each block and of the rest), the blocks' `blocks` times and the rest of the stage's
    `rest` times. With measured or cited bandwidths, one collective per `fully_shard` unit (each block, then the
    rest), each at its own size's rate; without, `blocks` messages of them all (what the fitted dp_factor was
    fitted to)."""
    units = unit_bytes(work, layout, bytes_per_param)
    if not (getattr(hw.measured, op) or hw.links.source):
        return blocks * link_time(hw, fit, op, sum(count * size for count, size in units), group, per_node)
    return sum(
        times * count * link_time(hw, fit, op, size, group, per_node)
        for times, (count, size) in zip((blocks, rest), units)
    )


def unit_bytes(work: Workload, layout: Layout, bytes_per_param: tuple[float, float]) -> list[tuple[int, float]]:
    """(count, bytes per device) of the `fully_shard` units of the stage (`sharded_units`: each block, then the
    rest) at `bytes_per_param` of each."""
    return [
        (count, params * nbytes) for (count, params), nbytes in zip(sharded_units(work.model, layout), bytes_per_param)
    ]


def fsdp_copies(
    work: Workload, layout: Layout, hw: HardwareProfile, gathers: tuple[int, int], reductions: int
) -> float:
    """Seconds `fully_shard` spends copying into and out of its flat communication buffers, at the measured
    bandwidth of a copy into a new buffer (else HBM's: the buffers are large): a gather (`gathers`: of each
    block, and of the rest) copies the shard in (when there is more than one) and the whole unit out, in the bytes
    it gathers (`gathered_bytes`); a reduction copies the whole gradient in and its shard out (with one shard, a
    plain copy). Replicated layouts pay these too: the trainer runs them as fully_shard over a shard group of
    one."""
    mode, ds = work.mode, layout.shards
    gather = 2 * (1 + (1 / ds if ds > 1 else 0))  # passes (read + write) over each gathered byte
    reduce = 2 * (1 + 1 / ds) * mode.grad_bytes
    moved = sum(
        count * params * (times * gather * nbytes + reductions * reduce)
        for times, nbytes, (count, params) in zip(
            gathers, gathered_bytes(work, layout), sharded_units(work.model, layout)
        )
    )
    return moved / ((hw.measured.copy_gbs or hw.hbm_gbs) * 1e9)


def measured_data_parallel(work: Workload, layout: Layout, hw: HardwareProfile, compute: float, m: int) -> float | None:
    """Exposed data-parallel time per step from blocks `hlat preflight` timed under the layout's own data
    parallelism (the same block shape, arrangement and data-parallel size, without a pipeline): the step's `m`
    micro-batches so wrapped (FSDP: each gathers and reduces; ZeRO-1 and DDP: the last reduces, the others
    accumulate) less the plain blocks' `compute` per micro-batch. None where preflight timed no such blocks."""
    if layout.dp == 1 or layout.pp > 1 or layout.cp > 1 or layout.sharding == "hsdp":
        return None
    model = work.model
    shape = layout.block_shape(work)
    per_micro_batch = []
    for accumulate in (False, layout.sharding != "fsdp"):
        timed = hw.measured.block(dp_block_shape(shape, layout.sharding, layout.dp, accumulate))
        if timed is None:
            return None
        per_micro_batch.append(model.n_layers * timed[0] + timed[1])
    last, others = per_micro_batch
    return max(0.0, last + (m - 1) * others - m * compute)


def dp_overlap(hw: HardwareProfile) -> float | None:
    """The share of data-parallel traffic that hides behind the compute it runs beside: as preflight measured it
    (with measured collectives); all of it with cited collectives (the trainer runs them on their own stream);
    None where the fitted dp_factor prices it."""
    if hw.measured.all_reduce and hw.measured.overlap >= 0:
        return hw.measured.overlap
    return 1.0 if hw.links.source and not hw.measured.all_reduce else None


def sends_overlap(hw: HardwareProfile) -> bool:
    """Whether the trainer's own overlap prices this profile's communication (measured beside compute, or taken
    from the trainer's streams with cited collectives), rather than factors fitted to another trainer's runs."""
    return (dp_overlap(hw) or 0.0) > 0


def data_parallel_time(work: Workload, layout: Layout, hw: HardwareProfile, fit: Fit, compute: float, m: int) -> float:
    """Exposed data-parallel communication per step (see the module's docstring for what overlaps). `compute`:
    one micro-batch's compute on the stage; `m`: micro-batches per step."""
    mode, dpn, ds = work.mode, hw.devices_per_node, layout.shards
    dp_per_node = max(1, dpn // layout.tp)  # ranks are ordered tp, then cp and dp (FSDP's dp_shard x cp), then pp
    overlap = dp_overlap(hw)

    def exposed(traffic: float, hideable: float) -> float:
        return traffic - (overlap or 0.0) * min(traffic, hideable)

    def raw(op: str, bytes_per_param: tuple[float, float], group: int, per_node: int) -> float:
        if overlap is not None:
            return dp_collective(work, layout, hw, fit, op, bytes_per_param, group, per_node)
        passes = 2 if op == "all_reduce" else 1
        nbytes = sum(count * size for count, size in unit_bytes(work, layout, bytes_per_param))
        return sum(collective(hw, nbytes, group, per_node, passes)) * fit.dp_factor

    grads, gathered = (mode.grad_bytes, mode.grad_bytes), gathered_bytes(work, layout)

    # Gathers per step of (each block, the rest): FSDP gathers a block before its forward and again before its
    # backward, every micro-batch, but keeps the root unit (the rest) from forward through backward; ZeRO-1 (and
    # any layout under a pipeline schedule) gathers once; a replicated layout reshards its blocks after each
    # forward but not after a backward that does not reduce, so the next forward finds them gathered.
    time, copies = 0.0, 0.0
    if layout.param_shard > 1 and layout.pp == 1:  # FSDP: gathered and reduced every micro-batch
        per_mb = dp_collective(work, layout, hw, fit, "all_gather", gathered, ds, dp_per_node, 2, 1) + dp_collective(
            work, layout, hw, fit, "reduce_scatter", grads, ds, dp_per_node
        )
        time = m * (exposed(per_mb, compute) if overlap is not None else max(0.0, per_mb - compute))
        copies = fsdp_copies(work, layout, hw, (2 * m, m), m)
    elif ds > 1:  # gathered once per step and kept (ZeRO-1, and FSDP under a pipeline schedule)
        traffic = raw("reduce_scatter", grads, ds, dp_per_node) + raw("all_gather", gathered, ds, dp_per_node)
        time = exposed(traffic, compute) if overlap is not None else traffic
        copies = fsdp_copies(work, layout, hw, (1, 1), 1)
    elif layout.dp > 1:
        traffic = raw("all_reduce", grads, layout.dp, dp_per_node)
        time = exposed(traffic, 2 / 3 * compute) if overlap is not None else traffic  # the last backward
        copies = fsdp_copies(work, layout, hw, (m + 1 if layout.pp == 1 else 1, 1), 1)
    # the copies are priced only with measured or cited figures: the fitted factors were fitted to other
    # trainers' runs
    time += copies if overlap is not None else 0.0
    if ds > 1 and layout.dp_replicate > 1:  # HSDP: the shards' gradients all-reduced across replicas, once
        time += raw("all_reduce", (mode.grad_bytes / ds,) * 2, layout.dp_replicate, max(1, dp_per_node // ds))
    return time
