"""The training run: config in, trained checkpoints and metrics out, on one process or many (torchrun).

`train` reads in the order the run happens (docs/architecture.md): everything checkable before any process group
(`check_inputs`) -> process group and mesh -> tokenizer -> model split, sharded, materialised and initialised ->
optimizers -> data stream -> the step and the run's services -> restore a checkpoint if resuming -> steps -> the
last commit. Each piece of work is a named helper below it; a step is `hlat.train.step.TrainStep`'s, what follows
it `hlat.train.trainer.Trainer`'s.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn

from hlat import HlatError
from hlat.checkpoint.durable import DamagedCheckpoint, set_aside
from hlat.checkpoint.resume import find_resume_checkpoint
from hlat.checkpoint.room import check_disk, checkpoint_bytes
from hlat.checkpoint.start import decide_start
from hlat.checkpoint.state import TrainState
from hlat.checkpoint.tiers import Tiers
from hlat.config.job import Config
from hlat.console import make_console
from hlat.data.packing import DataStream, Ranks, build_stream
from hlat.data.sources import Source, resolve_sources, source_files
from hlat.data.tokenizer import get_tokenizer
from hlat.dtensor import local_elements
from hlat.files import quiet_refused_writes_in_threads, write_text, writing
from hlat.groups import side_group
from hlat.models import build_model, count_params
from hlat.optim.fp8 import fp8_support
from hlat.parallel import ParallelConfig, Topology, init_topology
from hlat.parallel.device import pick_device
from hlat.train.assemble import Recipe, assemble, stage_shapes
from hlat.train.faults import StopRequest, Watchdog, hold_lease, lease_expired
from hlat.train.goodput import Goodput
from hlat.train.health import Health
from hlat.train.metrics import StepReport
from hlat.train.recovery import seeing_failures
from hlat.train.replicas import ReplicaGroups
from hlat.train.step import Batches, TrainStep
from hlat.train.tracking import require_backends
from hlat.train.trainer import Trainer
from hlat.train.validation import Validation


@dataclass
class Summary:
    run_dir: str
    steps: int
    tokens_seen: int
    tokens_per_s: float
    first_loss: float
    last_loss: float
    checkpoint: str
    ettr: float = 0.0  # effective training time ratio of the whole run so far (hlat.train.goodput)
    bad_steps: int = 0  # updates dropped by train.on_bad_step in this process
    recovery: dict | None = None  # the run's failures in total: detection, restart, load, recomputed (goodput.json)
    snapshots: dict | None = None  # the memory tier's interval and its newest snapshot's measured cost (None: off)


@dataclass
class RunInputs:
    """What a run starts from, checked before any process group exists."""

    layout: ParallelConfig  # resolved for this world size
    device: torch.device
    sources: list[Source]  # the data, resolved once for the run
    model: nn.Module  # on the meta device, not yet split or sharded
    n_params: int  # the whole model's, counted before it is split
    resume_from: Path | None
    passed_over: list[DamagedCheckpoint]  # damaged checkpoints newer than `resume_from`
    fp8: str  # how precision.fp8 runs on this device: "native" or "emulated" (hlat.optim.fp8.fp8_support)


def train(cfg: Config, console: Console | None = None) -> Summary:
    """Train `cfg` to `train.steps` on this process (one rank of a torchrun job, or the only one)."""
    entered, run_dir = time.time(), Path(cfg.train.run_dir)
    inputs = check_inputs(cfg)  # every mistake of the config is a one-line error here, before any process group
    if inputs.device.type == "cuda":
        enable_flight_recorder(run_dir)
    topo = init_topology(inputs.layout, inputs.device, cfg.train.collective_timeout_s)
    console = console if topo.is_main and console is not None else make_console(quiet=not topo.is_main)
    report_inputs(inputs, topo, console)
    quiet_refused_writes_in_threads()  # a full disk is reported once, in one line
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(destroy_process_group)
        cleanup.enter_context(hold_lease(cfg.train, topo))  # a silent peer is found in seconds from here on
        make_run_dir(cfg, topo)
        start = decide_start(cfg, topo, inputs.resume_from, inputs.model)  # one start for all ranks, both tiers
        for change in start.changes:
            console.print(f"resuming with a changed config: {change}", highlight=False)
        goodput = Goodput(run_dir, topo.is_main, entered, start.token)  # this start counts from here
        cleanup.push(goodput.take_back_if_refused)
        tokenizer = load_tokenizer(cfg, topo, inputs.sources)
        per_rank = inputs.layout.microbatches(cfg.train.global_batch, cfg.train.micro_batch)
        parts = assemble(
            inputs.model,
            topo,
            inputs.device,
            Recipe.of(cfg, inputs.fp8, per_rank),
            # a resume (or train.init_from) loads every weight: drawing them first would only slow its start
            weights="loaded" if start.path is not None or cfg.train.init_from else "drawn",
            # MoE stages take their shapes: shape inference runs a backward, which would count routing figures
            shapes=stage_shapes(cfg) if cfg.model.moe else None,
        )
        stream = open_stream(cfg, topo, tokenizer, inputs.sources)
        cleanup.callback(stream.close)  # stops the tokenizer workers
        batches = Batches(stream, topo, per_rank)
        health = Health(cfg.health, topo, inputs.device, parts.parts, console)
        state = TrainState(parts.parts, parts.optimizers, stream, batches.state_key)
        replicas = replica_groups(cfg, topo, state, batches)
        trainer = Trainer(
            cfg=cfg,
            console=console,
            state=state,
            train_step=TrainStep(cfg, topo, inputs.device, parts, batches, health, replicas and replicas.all_reduce),
            goodput=goodput,
            tiers=Tiers(cfg, topo, inputs.device, state, goodput, console, start, replicas and replicas.takes_turn),
            report=StepReport(cfg, inputs.device, topo.world_size, topo.is_main, console),
            validation=Validation(cfg, tokenizer, inputs.sources),
            watchdog=Watchdog(cfg.train.hang_timeout_s, run_dir, topo.rank, topo.world_size),
        )
        cleanup.callback(trainer.tiers.close)
        cleanup.callback(trainer.report.close)
        # entered last, so it exits first: a failure is recorded when seen, before the clean-up above runs
        cleanup.enter_context(seeing_failures(run_dir, f"rank{topo.rank}", goodput.refused))
        trainer.restore()
        check_room(trainer, inputs)
        announce(trainer, inputs)
        goodput.start_up_done()
        run_steps(trainer, replicas)
        trainer.tiers.finish()
        goodput.finished()
        return summary(trainer, inputs.resume_from)


def check_inputs(cfg: Config) -> RunInputs:
    """The layout against the world size, the device, the data sources, the checkpoint to resume from (its weights
    and config are checked against this run's once the ranks agreed where to start: `decide_start`), the tracking
    packages, and the model on the meta device."""
    layout = cfg.resolved_parallel()
    device = pick_device(cfg.train.device)
    fp8 = fp8_support(cfg.precision.fp8, device)
    sources = resolve_sources(cfg.data)
    resume_from, passed_over = find_resume_checkpoint(cfg)
    require_backends(cfg.tracking)
    model = build_model(cfg.model)
    return RunInputs(layout, device, sources, model, count_params(model), resume_from, passed_over, fp8)


def report_inputs(inputs: RunInputs, topo: Topology, console: Console) -> None:
    """Say first that FP8 is emulated where it is, and set the damaged checkpoints passed over aside (so that rotation
    counts only good ones)."""
    if inputs.fp8 == "emulated":
        console.print(
            f"precision.fp8: FP8 matmuls emulated on {inputs.device.type} (torchao: FP8's numerics, not its speed)",
            highlight=False,
        )
    set_aside(inputs.passed_over, topo.is_main, console)


def enable_flight_recorder(run_dir: Path) -> None:
    """NCCL's flight recorder keeps the last collectives of each rank and dumps them when a collective times
    out, into `<run>/hang/` (a user's own settings win)."""
    (run_dir / "hang").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        os.environ.setdefault(name, str(run_dir / "hang" / "nccl_trace_rank_"))


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def make_run_dir(cfg: Config, topo: Topology) -> None:
    """Rank 0 creates the run directory and writes the config into it."""
    run_dir = Path(cfg.train.run_dir)
    if topo.is_main:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise HlatError(f"train.run_dir: cannot write {e.filename or run_dir}: {e.strerror}") from None
        write_text(run_dir / "config.toml", cfg.run_record(topo.cfg), run_dir)


def load_tokenizer(cfg: Config, topo: Topology, sources: list[Source]):
    """Rank 0 trains the tokenizer (once, saved in the run directory); the other ranks then load it."""
    run_dir = Path(cfg.train.run_dir)
    if topo.is_main:
        with writing(run_dir, run_dir, "the tokenizer into "):
            tokenizer = get_tokenizer(cfg.data, source_files(sources), cfg.model.vocab_size, run_dir)
    if dist.is_initialized():
        dist.barrier()
    if not topo.is_main:
        tokenizer = get_tokenizer(cfg.data, source_files(sources), cfg.model.vocab_size, run_dir)
    return tokenizer


def open_stream(cfg: Config, topo: Topology, tokenizer, sources: list[Source]) -> DataStream:
    """This rank's data stream: its part of the global stream, shared with all ranks over a CPU side group, or
    (data_sharding = "files") a stream of its data-parallel rank's own files."""
    settings, layout = cfg.train, topo.cfg
    args = (cfg.data, tokenizer, sources, settings.seq_len, settings.micro_batch)
    # documents held out for validation (a hash split, when no eval.paths are given) are skipped in training
    common = dict(doc_mask=cfg.model.doc_mask, holdout=0.0 if cfg.eval.paths else cfg.eval.holdout)
    if layout.data_sharding == "files":
        return build_stream(*args, shard=(topo.dp_rank, layout.dp), **common)
    per_step = settings.global_batch // settings.micro_batch  # micro-batches of the whole step, over all ranks
    ranks = Ranks(side_group(settings.collective_timeout_s), topo.dp_rank, layout.dp, per_step)
    return build_stream(*args, ranks=ranks, **common)


def check_room(trainer: Trainer, inputs: RunInputs) -> None:
    """Before the first step: room for the checkpoints the run keeps, against the size of one (refused in one line,
    or a warning when every checkpoint is kept), and for the memory tier's snapshots (its cost per rank said; where
    they do not fit, a restart goes on without them): `hlat.checkpoint.room`."""
    tiers, mode = trainer.tiers, trainer.cfg.precision.mode
    size = checkpoint_bytes(inputs.resume_from, inputs.n_params, mode)
    disk = check_disk(tiers.rotation, trainer.step, size, local_elements(trainer.model.params))
    for line in filter(None, [disk, tiers.room_for_memory(mode)]):
        trainer.console.print(line, soft_wrap=True, highlight=False, markup=False)


def announce(trainer: Trainer, inputs: RunInputs) -> None:
    cfg, world = trainer.cfg, trainer.train_step.topo.world_size
    trainer.console.print(
        f"training {cfg.model.preset or cfg.model.family} ({inputs.n_params:,} parameters) on {inputs.device}"
        f"{f' x {world} ranks' if dist.is_initialized() else ''}, {cfg.train.steps} steps of "
        f"{cfg.train.tokens_per_step:,} tokens, run dir {cfg.train.run_dir}",
        soft_wrap=True,
        highlight=False,
    )


def replica_groups(cfg: Config, topo: Topology, state: TrainState, batches: Batches) -> ReplicaGroups | None:
    """This rank's side of parallel.replica_groups (None when off), which needs the hlat service."""
    layout = topo.cfg
    if not layout.replica_groups:
        return None
    if topo.store is None or not topo.store.service:
        raise HlatError(
            "parallel.replica_groups: each replica group meets the others at the hlat service: run each group with "
            "hlat torchrun --rdzv-backend=hlat (hlat launch renders it)"
        )
    settings = cfg.train
    act = functools.partial(lease_expired, Path(settings.run_dir), topo.rank, replica_group=layout.replica_group)
    return ReplicaGroups(
        topo,
        layout.replica_group,
        layout.replica_groups,
        settings.collective_timeout_s,
        settings.lease_s or 10.0,
        Path(settings.run_dir),
        state,
        batches,
        act,
    )


def run_steps(trainer: Trainer, replicas: ReplicaGroups | None = None) -> None:
    """Steps until `train.steps`, or until a stop signal, after which the run checkpoints and stops. Under replica
    groups each step starts in the epoch the group agrees on (joining, and healing, in a new one), and a step whose
    cross-replica all-reduce failed somewhere is run again."""
    with StopRequest().installed() as stop, trainer.watchdog, replicas or contextlib.nullcontext():
        while trainer.step < trainer.cfg.train.steps:
            if replicas is not None:
                replicas.begin()
                if trainer.step >= trainer.cfg.train.steps:  # healed to the end
                    break
            result = trainer.train_step(trainer.step, stop.requested, trainer.tiers.writes())
            if result.redo:
                replicas.step_failed()
                continue
            if replicas is not None:
                replicas.committed()
            trainer.batches.committed()
            trainer.after_step(result)
            if result.stopping:
                trainer.console.print(
                    f"stopped by signal at step {trainer.step}; checkpoint "
                    f"{trainer.tiers.saved}; resume with --resume auto"
                )
                return


def summary(trainer: Trainer, resume_from: Path | None) -> Summary:
    settings, report = trainer.cfg.train, trainer.report
    elapsed = time.perf_counter() - report.run_start
    ran = trainer.step - trainer.start
    return Summary(
        run_dir=str(Path(settings.run_dir)),
        steps=trainer.step,
        tokens_seen=trainer.step * settings.tokens_per_step,
        tokens_per_s=ran * settings.tokens_per_step / elapsed if elapsed > 0 else 0.0,
        first_loss=report.first_loss(),
        last_loss=report.losses[-1] if report.losses else float("nan"),
        checkpoint=str(trainer.tiers.saved or resume_from or ""),
        ettr=trainer.goodput.ettr(),
        bad_steps=trainer.train_step.bad_steps.total,
        recovery=trainer.goodput.recovery(),
        snapshots=trainer.tiers.metric_fields() or None,
    )
