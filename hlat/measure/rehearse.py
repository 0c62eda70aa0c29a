"""`hlat rehearse`: one process becomes rank R of the full-size job (a fake process group: every collective and
pipeline send completes at once, every local tensor keeps its real shape) and runs the trainer's own path: the
config's checks, the mesh, the model on meta, its split, sharding and precision, the optimizer, the checkpoint's
state dict, and training steps of that rank's real compute (the trainer's own `hlat.train.step.TrainStep`). It
measures what the rank holds (`hlat.measure.footprint`), what its step computes and issues
(`hlat.measure.traffic`), and sets the planner's figures for the same layout and rank beside them
(`hlat.planner.rehearsal`).

What cannot run in a fake world is replaced and said so: the data stream (its ranks exchange over a side group)
by random tokens, the checkpoint write (DCP agrees on a plan across ranks) by counting the state dict it would
write, the pipeline's shape inference by the stages' shapes (`hlat.parallel.pipeline.StageShapes`)."""

from __future__ import annotations

import contextlib
import copy
import multiprocessing
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from hlat import HlatError
from hlat.checkpoint.state import TrainState
from hlat.config.job import Config
from hlat.console import make_console
from hlat.measure.fake_world import Deliveries, join_fake_world
from hlat.measure.footprint import KeptForBackward, available_bytes, meta_elements, optimizer_tensors, storages
from hlat.measure.progress import Progress
from hlat.measure.report import local_profile
from hlat.measure.timing import sync_device
from hlat.measure.traffic import Collectives, group_names
from hlat.models import build_model
from hlat.optim.fp8 import fp8_support
from hlat.parallel import ParallelConfig, Topology, init_topology, shard_parts
from hlat.parallel.device import pick_device
from hlat.planner.layout import Layout, Workload, layout_problem
from hlat.planner.memory import GIB
from hlat.planner.rehearsal import RankPlan, rank_plan, rank_traffic
from hlat.profiles import HardwareProfile, load_profile
from hlat.train.assemble import Recipe, assemble, stage_shapes
from hlat.train.faults import BadSteps
from hlat.train.health import Health
from hlat.train.metrics import peak_memory_bytes
from hlat.train.step import Batches, ModelParts, TrainStep


@dataclass
class Rehearsal:
    """One rehearsal's settings, checked: the config as `hlat train` would run it at `world_size`, and what is
    rehearsed of it."""

    cfg: Config
    world_size: int
    layout: ParallelConfig  # resolved by the trainer's own check
    ranks: list[int]
    steps: int
    micro_batches: int  # rehearsed per step (of `step_micro_batches`)
    step_micro_batches: int
    hardware: HardwareProfile  # the local device's, for the planner's compute and activations
    target: HardwareProfile | None  # the cluster's ([cluster] hardware), whose memory the rank must fit
    changes: list[str] = field(default_factory=list)  # what the command line changed of the job its config states
    full_layers: int = 0  # the config's model.n_layers when the rehearsal shortened the model (0: not shortened)

    @property
    def work(self) -> Workload:
        """The planner's workload; under expert parallelism at an even load: in a fake world a rank's experts receive
        from each peer what the rank sends that peer's experts (`hlat.models.moe.ExpertDispatch`), as many choices in
        all as it routes."""
        cfg = self.cfg
        return Workload(cfg.model, cfg.train.seq_len, cfg.train.global_batch, cfg.precision.mode, cfg.parallel.compile)

    @property
    def planned_layout(self) -> Layout:
        return Layout(self.layout, self.cfg.train.micro_batch)


def prepare(
    cfg: Config,
    world_size: int | None,
    ranks: list[int] | None,
    steps: int,
    micro_batches: int | None,
    hardware: str | None,
) -> Rehearsal:
    """The rehearsal's settings, every mistake a one-line error: the layout is refused exactly as `hlat train`
    refuses it at this world size."""
    world = world_size or cfg.cluster.world_size
    layout = cfg.resolved_parallel(world)
    step_micro_batches = layout.microbatches(cfg.train.global_batch, cfg.train.micro_batch)
    micro = micro_batches or step_micro_batches
    check_micro_batches(layout, micro, step_micro_batches)
    if steps < 1:
        raise HlatError(f"--steps: must be >= 1, got {steps}")
    last = world - world // layout.pp  # the first rank of the last pipeline stage
    ranks = ranks if ranks is not None else sorted({0, last})
    for rank in ranks:
        if not 0 <= rank < world:
            raise HlatError(f"--rank: {rank} is not a rank of a world of {world}")
    device = pick_device(cfg.train.device)
    local = load_profile(hardware or local_profile(device))
    target = load_profile(cfg.cluster.hardware) if cfg.cluster.hardware else None
    return Rehearsal(cfg, world, layout, ranks, steps, micro, step_micro_batches, local, target)


def check_micro_batches(layout: ParallelConfig, micro: int, step: int) -> None:
    if not 1 <= micro <= step:
        raise HlatError(f"--micro-batches: {micro} is not between 1 and the step's {step}")
    if layout.pp > 1 and layout.pp_schedule != "gpipe" and micro < layout.pp:
        raise HlatError(
            f"--micro-batches: the {layout.pp_schedule} schedule needs at least pp = {layout.pp} "
            f"micro-batches, got {micro}"
        )
    if layout.pp > 1 and layout.pp_schedule == "interleaved_1f1b" and micro % layout.pp:
        raise HlatError(f"--micro-batches: interleaved_1f1b needs a multiple of pp = {layout.pp}, got {micro}")


def rehearse(setup: Rehearsal) -> list[dict]:
    """Each rank in turn, each in a process and a fake world of its own (as on the cluster: nothing one rank
    allocates is left for the next to find). The last runs in this process, which no other rank follows: one start
    of Python and torch fewer (about 4 s on a CPU)."""
    results = []
    for rank in setup.ranks[:-1]:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            results.append(pool.apply(rehearse_rank, (setup, rank)))
    return [*results, rehearse_rank(setup, setup.ranks[-1])]


def rehearse_rank(setup: Rehearsal, rank: int) -> dict:
    join_fake_world(rank, setup.world_size)
    try:
        # only a pipeline receives (Deliveries sends every op through Python: kept out of the timed steps otherwise)
        deliveries = Deliveries() if setup.layout.pp > 1 else contextlib.nullcontext()
        with deliveries:
            return run_rank(setup, rank)
    finally:
        dist.destroy_process_group()


def run_cfg(setup: Rehearsal) -> Config:
    """The config the rank trains with: the rehearsed micro-batches per step."""
    train = replace(setup.cfg.train, global_batch=setup.micro_batches * setup.cfg.train.micro_batch * setup.layout.dp)
    return replace(setup.cfg, train=train)


def run_rank(setup: Rehearsal, rank: int) -> dict:
    cfg, device = run_cfg(setup), pick_device(setup.cfg.train.device)
    progress = Progress(rank, setup.world_size)
    reset_peak(device)
    model = build_model(cfg.model)
    topo = init_topology(setup.layout, device)
    plan = rank_plan(setup.work, setup.planned_layout, setup.hardware, topo.pp_rank, setup.micro_batches)
    check_fits(setup, topo, model, plan, device)
    blocks = f"{plan.layers} block{'s' * (plan.layers != 1)}"
    progress.say(f"start-up: its {blocks} split, sharded, materialised and initialised on {device}")
    started = time.perf_counter()
    # weights drawn per shard: the trainer's full draws cost a full-size rank minutes, and need not be the same
    # whatever the layout here
    per_rank = topo.cfg.microbatches(cfg.train.global_batch, cfg.train.micro_batch)
    recipe = Recipe.of(cfg, fp8_support(cfg.precision.fp8, device), per_rank)
    parts = assemble(model, topo, device, recipe, weights="per_shard", shapes=stage_shapes(cfg))
    startup_s = time.perf_counter() - started
    train_step = rehearsal_step(cfg, topo, device, parts)
    with progress.watching(parts.parts[0], train_step.batches.per_rank):  # a line per micro-batch on long steps
        steps = run_steps(train_step, setup.steps, progress)
    report = rank_report(setup, topo, train_step, steps, plan)
    report["time"]["startup_s"] = startup_s
    report["peak_memory"] = peak_memory(device)
    return report


def check_fits(setup: Rehearsal, topo: Topology, model, plan: RankPlan, device: torch.device) -> None:
    """Before anything is allocated: the rank's model states, counted from its (meta) tensors as sharded, and
    what the planner says it gathers and keeps for backward, against the memory free here."""
    parts = [part for _, part in shard_parts(copy.deepcopy(model), topo)]
    states = meta_elements(parts) * setup.work.mode.bytes_per_param
    needed, free = states + plan.gathered + plan.activations + plan.casts + plan.rebuilt, available_bytes(device)
    if needed > free:
        raise HlatError(
            f"rank {topo.rank} needs {needed / GIB:.1f} GiB ({states / GIB:.1f} GiB of model states "
            f"counted from its tensors, {(needed - states) / GIB:.1f} GiB gathered and kept for "
            f"backward as the planner predicts) but {device} has {free / GIB:.1f} GiB available"
        )


class SyntheticTokens:
    """The data stream's place: random token ids of the run's shape (the stream's ranks exchange over a side group,
    which a fake world cannot carry, and the recipe's data need not be here)."""

    def __init__(self, cfg: Config):
        self.cfg, self.generator, self.wait_time_s = cfg, torch.Generator().manual_seed(cfg.train.seed), 0.0

    def __next__(self) -> dict[str, torch.Tensor]:
        settings = self.cfg.train
        rows = torch.randint(
            0, self.cfg.model.vocab_size, (settings.micro_batch, settings.seq_len + 1), generator=self.generator
        )
        batch = {"inputs": rows[:, :-1].contiguous(), "targets": rows[:, 1:].contiguous()}
        if self.cfg.model.doc_mask:  # one document per row
            batch["doc_ids"] = torch.zeros_like(batch["inputs"])
            batch["positions"] = torch.arange(settings.seq_len).expand_as(batch["inputs"]).contiguous()
        return batch

    def state_dict(self) -> dict:
        return {"synthetic": True}


def rehearsal_step(cfg: Config, topo: Topology, device: torch.device, parts: ModelParts) -> TrainStep:
    """The trainer's step on random tokens; the slow-rank check, which compares ranks that are not there, is off
    (the services after a step, metrics, checkpoints and validation, are not rehearsed)."""
    per_rank = topo.cfg.microbatches(cfg.train.global_batch, cfg.train.micro_batch)
    health = Health(replace(cfg.health, slow_intervals=0), topo, device, parts.parts, make_console(quiet=True))
    train_step = TrainStep(cfg, topo, device, parts, Batches(SyntheticTokens(cfg), topo, per_rank), health)
    train_step.bad_steps = UpdateAnyway()
    return train_step


class UpdateAnyway(BadSteps):
    """A rehearsal's numbers mean nothing (a faked collective delivers whatever its buffer held, NaN included), so
    every update runs and the gradients it reads and the optimizer states it allocates are measured; `reason`
    keeps why a real run would have dropped one."""

    def __init__(self):
        super().__init__(spike_sigmas=0.0, max_in_a_row=0)
        self.reason: str | None = None

    def check(self, loss: float, grad_norm: float) -> None:
        self.reason = super().check(loss, grad_norm) or self.reason
        return None


class PhaseClock:
    """Seconds a step spends in its parts' forward passes and in its optimizers' updates (hooks on both; the rest
    is backward, the loss, the step's all-reduce, the gradient norm, and clipping unless BF16AdamW does it in its
    update), and the gradients' bytes as the updates read them."""

    def __init__(self, parts: ModelParts, device: torch.device):
        self.device, self.forward_s, self.update_s, self.grads, self.began = device, 0.0, 0.0, 0, 0.0
        self.handles = [
            hook
            for part in parts.parts
            for hook in (part.register_forward_pre_hook(self.start), part.register_forward_hook(self.stop_forward))
        ]
        self.handles += [
            hook
            for opt in parts.optimizers
            for hook in (opt.register_step_pre_hook(self.start_update), opt.register_step_post_hook(self.stop_update))
        ]

    def now(self) -> float:
        sync_device(self.device)
        return time.perf_counter()

    def start(self, *_) -> None:
        self.began = self.now()

    def stop_forward(self, *_) -> None:
        self.forward_s += self.now() - self.began

    def start_update(self, optimizer, *_) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        self.grads += sum(storages(grads).values())
        self.start()

    def stop_update(self, *_) -> None:
        self.update_s += self.now() - self.began

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@dataclass
class Steps:
    """What the rehearsed steps did; the last one's collectives, phases and memory."""

    seconds: list[float]  # each step's wall time (the last one's less the memory sampling)
    forward_s: float
    update_s: float
    grads: int
    collectives: Collectives
    kept: KeptForBackward
    non_finite: str | None  # why a real run would have dropped an update (which ran here all the same)


def run_steps(train_step: TrainStep, steps: int, progress: Progress) -> Steps:
    """`steps` training steps of the trainer's `TrainStep`; the last one records its collectives and samples what
    it keeps for backward."""
    seconds, dims = [], group_names(train_step.topo)
    sharding = {name for name, dim in dims.items() if dim == train_step.topo.cfg.fsdp_dim}
    for i in range(steps):
        progress.step(i + 1, steps)
        with contextlib.ExitStack() as stack:
            if i == steps - 1:  # hooks and synchronisations only where they are read
                clock = PhaseClock(train_step.parts, train_step.device)
                stack.callback(clock.remove)
                collectives = stack.enter_context(Collectives(dims))
                kept = stack.enter_context(KeptForBackward(train_step.parts.parts, sharding))
            result = train_step(i, stop_requested=False)
        seconds.append(result.seconds)
    seconds[-1] -= kept.seconds
    return Steps(seconds, clock.forward_s, clock.update_s, clock.grads, collectives, kept, train_step.bad_steps.reason)


def reset_peak(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict:
    """The allocator's peak, or on the CPU the rank's process's resident set at its largest (torch and Python
    themselves included)."""
    kind = "process resident set peak" if device.type == "cpu" else f"{device.type} allocator peak"
    return {"kind": kind, "bytes": peak_memory_bytes(device)}


def rank_report(setup: Rehearsal, topo: Topology, train_step: TrainStep, steps: Steps, plan: RankPlan) -> dict:
    """What the rank holds, computes and issues, beside the planner's figures for it."""
    model, m, M = train_step.parts, setup.step_micro_batches, setup.micro_batches
    params = [p for part in model.parts for p in part.parameters()]
    measured = {
        "params": sum(storages(params).values()),
        "grads": steps.grads,
        "optimizer": sum(storages(optimizer_tensors(model.optimizers)).values()),
        **steps.kept.peak,
    }
    planned = {
        "params": plan.params,
        "grads": plan.grads,
        "optimizer": plan.optimizer,
        "gathered": plan.gathered,
        "activations": plan.activations,
        "parameter_casts": plan.casts,
    }
    memory = {k: {"measured": measured[k], "planned": planned[k]} for k in planned}
    step_plan = rank_plan(setup.work, setup.planned_layout, setup.hardware, topo.pp_rank)
    in_flight = step_plan.activations / plan.activations if plan.activations else 1.0
    memory["activations"]["step"] = {"measured": measured["activations"] * in_flight, "planned": step_plan.activations}
    step_s = steps.seconds[-1]
    forward_backward = step_s - steps.update_s
    return {
        "rank": topo.rank,
        "coordinates": {"pp": topo.pp_rank, "dp": topo.dp_rank, "cp": topo.cp_rank, "tp": topo.tp_rank},
        "stages": topo.cfg.rank_stages(topo.pp_rank),
        "layers": plan.layers,
        "memory": memory,
        "fits": target_fit(setup, measured, in_flight),
        "full_job_fits": full_job_fit(setup, topo.pp_rank, measured, in_flight),
        "time": {
            "steps_s": steps.seconds,
            "forward_s": steps.forward_s,
            "update_s": steps.update_s,
            "backward_and_rest_s": forward_backward - steps.forward_s,
            "compute_s": {"measured": forward_backward, "planned": plan.compute_s},
            "step_compute_s": {"measured": forward_backward * m / M, "planned": step_plan.compute_s},
        },
        "collectives": scaled_collectives(
            steps.collectives.rows(),
            setup,
            rank_traffic(setup.work, setup.planned_layout, setup.hardware, topo.pp_rank, m),
        ),
        "checkpoint": {
            **TrainState(train_step.parts.parts, train_step.parts.optimizers, None).nbytes(),
            "planned": plan.params + plan.optimizer,
        },
        "non_finite": steps.non_finite,
    }


def target_fit(setup: Rehearsal, measured: dict, in_flight: float) -> dict | None:
    """Whether the rank, as measured (its activations at the step's micro-batches), fits one device of the
    recipe's cluster with that profile's overhead."""
    if setup.target is None:
        return None
    needed = sum(measured.values()) + measured["activations"] * (in_flight - 1) + setup.target.overhead_gib * GIB
    capacity = setup.target.memory_gib * GIB
    return {"hardware": setup.target.name, "needed": needed, "capacity": capacity, "fits": needed <= capacity}


# a measured figure and the planner's `RankPlan` field that predicts it
PLANNED = {
    "params": "params",
    "grads": "grads",
    "optimizer": "optimizer",
    "gathered": "gathered",
    "activations": "activations",
    "parameter_casts": "casts",
}


def full_job_fit(setup: Rehearsal, pp_rank: int, measured: dict, in_flight: float) -> dict | None:
    """For a rehearsal that shortened the model (model.n_layers): the fit at the config's depth, each measured
    figure plus what the planner adds to it for the blocks the rank would hold in full (the embedding's and the
    head's share, which the planner may not price exactly, stays as measured); why not, where the full job's
    layout is refused."""
    if not setup.full_layers or setup.target is None:
        return None
    work, layout = setup.work, setup.planned_layout
    full = replace(work, model=replace(work.model, n_layers=setup.full_layers))
    if problem := layout_problem(full, layout, setup.world_size):
        return {"n_layers": setup.full_layers, "cannot": problem}
    ours, theirs = (rank_plan(w, layout, setup.hardware, pp_rank, setup.step_micro_batches) for w in (work, full))
    at_step = {**measured, "activations": measured["activations"] * in_flight}
    needed = setup.target.overhead_gib * GIB + sum(
        value + getattr(theirs, PLANNED[k]) - getattr(ours, PLANNED[k]) for k, value in at_step.items()
    )
    capacity = setup.target.memory_gib * GIB
    return {
        "n_layers": setup.full_layers,
        "hardware": setup.target.name,
        "needed": needed,
        "capacity": capacity,
        "fits": needed <= capacity,
    }


def scaled_collectives(rows: list[dict], setup: Rehearsal, planned: dict[tuple[str, str], float]) -> list[dict]:
    """The rehearsed step's collectives, and per the real step's micro-batches, beside the bytes the planner prices
    for the real step (a kind the planner prices that the rank did not issue is a row of its own). Once per
    micro-batch: tensor parallelism's gathers and reductions (its all-reduces only without sequence parallelism,
    where they carry the activations; with it they reduce norm gradients once a step), context parallelism's
    (keys and values, positions, token counts), pipeline sends, and FSDP's gathers and reductions without a
    pipeline; the rest once per step."""
    p = setup.layout
    fsdp_per_micro_batch = p.shards > 1 and not p.zero1 and p.pp == 1
    per_micro_batch = {
        ("all_gather", "tp"),
        ("reduce_scatter", "tp"),
        ("send", "pp"),
        ("recv", "pp"),
        ("all_gather", "cp"),
        ("reduce_scatter", "cp"),
        ("all_reduce", "cp"),
    }
    per_micro_batch |= set() if p.sequence_parallel else {("all_reduce", "tp")}
    per_micro_batch |= {("all_to_all", "ep")} if p.ep > 1 else set()
    fsdp_dims = (p.fsdp_dim, "ep_shard") if p.ep > 1 else (p.fsdp_dim,)
    per_micro_batch |= (
        {(kind, d) for kind in ("all_gather", "reduce_scatter") for d in fsdp_dims} if fsdp_per_micro_batch else set()
    )
    ratio = setup.step_micro_batches / setup.micro_batches
    rows += [
        {"kind": kind, "dim": dim, "count": 0, "bytes": 0}
        for kind, dim in planned
        if not any((row["kind"], row["dim"]) == (kind, dim) for row in rows)
    ]
    for row in rows:
        repeats = (row["kind"], row["dim"]) in per_micro_batch
        row["step_count"] = row["count"] * (ratio if repeats else 1)
        row["step_bytes"] = row["bytes"] * (ratio if repeats else 1)
        row["planned_step_bytes"] = planned.get((row["kind"], row["dim"]), 0.0)
    return rows
