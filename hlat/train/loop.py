"""The training run: config in, trained checkpoints and metrics out, on one process or many (torchrun).

`train` reads in the order the run happens (docs/architecture.md): everything checkable before any process group
(`check_inputs`) -> process group and mesh -> tokenizer -> model split, sharded, materialised and initialised ->
optimizers -> data stream -> the step and the run's services -> restore a checkpoint if resuming -> steps -> the
last commit. Each piece of work is a named helper below it; a step is `hlat.train.step.TrainStep`'s, what follows
it `hlat.train.trainer.Trainer`'s.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from hlat import HlatError
from hlat.checkpoint.resume import check_start, find_resume_checkpoint
from hlat.checkpoint.run import Checkpoints, checkpoint_bytes
from hlat.checkpoint.start import agree_on_start
from hlat.checkpoint.state import TrainState
from hlat.checkpoint.store import DamagedCheckpoint, set_aside
from hlat.config.job import Config
from hlat.console import make_console
from hlat.data.exchange import side_group
from hlat.data.packing import DataStream, Ranks, build_stream
from hlat.data.sources import Source, resolve_sources, source_files
from hlat.data.tokenizer import get_tokenizer
from hlat.dtensor import local_elements
from hlat.files import quiet_refused_writes_in_threads, write_text, writing
from hlat.models import build_model, count_params
from hlat.optim import build_optimizer
from hlat.optim.fp8 import convert_blocks, fp8_support, precompute_scales_after_step
from hlat.optim.precision import autocast, dtypes, prepare_model
from hlat.parallel import ParallelConfig, Topology, init_topology, parallelize
from hlat.parallel.device import pick_device
from hlat.parallel.pipeline import StageShapes, build_schedule
from hlat.train.faults import StopRequest, Watchdog
from hlat.train.goodput import Goodput
from hlat.train.health import Health
from hlat.train.metrics import StepReport
from hlat.train.recovery import seeing_failures
from hlat.train.step import Batches, ModelParts, TrainStep
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
    changes: list[str]  # what the config changes against the checkpoint's
    fp8: str  # how precision.fp8 runs on this device: "native" or "emulated" (hlat.optim.fp8.fp8_support)


def train(cfg: Config, console: Console | None = None) -> Summary:
    """Train `cfg` to `train.steps` on this process (one rank of a torchrun job, or the only one)."""
    entered = time.time()
    inputs = check_inputs(cfg)  # every mistake is a one-line error here, before any process group starts
    if inputs.device.type == "cuda":
        enable_flight_recorder(Path(cfg.train.run_dir))
    topo = init_topology(inputs.layout, inputs.device, cfg.train.collective_timeout_s)
    console = console if topo.is_main and console is not None else make_console(quiet=not topo.is_main)
    report_inputs(inputs, topo, console)
    quiet_refused_writes_in_threads()  # a full disk is reported once, in one line
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(destroy_process_group)
        make_run_dir(cfg, topo)
        start = agree_on_start(cfg, topo, inputs.resume_from, inputs.model)  # one start for all ranks, both tiers
        for change in start.changes or []:
            console.print(f"resuming with a changed config: {change}", highlight=False)
        goodput = Goodput(Path(cfg.train.run_dir), topo.is_main, entered)  # this start counts from here
        tokenizer = load_tokenizer(cfg, topo, inputs.sources)
        # a resume (or train.init_from) loads every weight: drawing them first would only slow its start
        parts = build_parts(
            cfg,
            inputs.model,
            topo,
            inputs.device,
            inputs.fp8,
            weights="loaded" if start.path is not None or cfg.train.init_from else "drawn",
        )
        stream = open_stream(cfg, topo, tokenizer, inputs.sources)
        cleanup.callback(stream.close)  # stops the tokenizer workers
        per_rank = inputs.layout.microbatches(cfg.train.global_batch, cfg.train.micro_batch)
        batches = Batches(stream, topo, per_rank)
        train_step = TrainStep(
            cfg, topo, inputs.device, parts, batches, Health(cfg.health, topo, inputs.device, parts.parts, console)
        )
        state = TrainState(parts.parts, parts.optimizers, stream, batches.state_key)
        trainer = Trainer(
            cfg=cfg,
            console=console,
            train_step=train_step,
            goodput=goodput,
            checkpoints=Checkpoints(cfg, topo, inputs.device, state, goodput, console, start),
            report=StepReport(cfg, inputs.device, topo.world_size, topo.is_main, console),
            validation=Validation(cfg, tokenizer, inputs.sources),
            watchdog=Watchdog(cfg.train.hang_timeout_s, Path(cfg.train.run_dir), topo.rank, topo.world_size),
        )
        cleanup.callback(trainer.checkpoints.close)
        cleanup.callback(trainer.report.close)
        # entered last, so it exits first: a failure is recorded when seen, before the clean-up above runs
        cleanup.enter_context(seeing_failures(Path(cfg.train.run_dir), f"rank{topo.rank}"))
        trainer.restore()
        check_disk(trainer, inputs)
        announce(trainer, inputs)
        goodput.start_up_done()
        run_steps(trainer)
        trainer.checkpoints.finish()
        goodput.finished()
        return summary(trainer, inputs.resume_from)


def check_inputs(cfg: Config) -> RunInputs:
    """The layout against the world size, the device, the data sources, the checkpoint to resume from, the
    tracking packages, and that the checkpoint's weights fit the model and its config changes are allowed."""
    layout = cfg.resolved_parallel()
    device = pick_device(cfg.train.device)
    fp8 = fp8_support(cfg.precision.fp8, device)
    sources = resolve_sources(cfg.data)
    resume_from, passed_over = find_resume_checkpoint(cfg)
    require_backends(cfg.tracking)
    model = build_model(cfg.model)
    changes = check_start(cfg, resume_from, model)
    return RunInputs(layout, device, sources, model, count_params(model), resume_from, passed_over, changes, fp8)


def report_inputs(inputs: RunInputs, topo: Topology, console: Console) -> None:
    """Say first that FP8 is emulated where it is, then what a resume changes, and set the damaged checkpoints
    passed over aside (so that rotation counts only good ones)."""
    if inputs.fp8 == "emulated":
        console.print(
            f"precision.fp8: FP8 matmuls emulated on {inputs.device.type} (torchao: FP8's numerics, not its speed)",
            highlight=False,
        )
    for change in inputs.changes:
        console.print(f"resuming with a changed config: {change}", highlight=False)
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


def build_parts(
    cfg: Config,
    model: nn.Module,
    topo: Topology,
    device: torch.device,
    fp8: str,
    shapes: StageShapes | None = None,
    weights: str = "drawn",
) -> ModelParts:
    """This rank's parts of the meta-device `model`, in the precision mode's dtype (cast on meta, before sharding)
    with the blocks' linear layers in FP8 under precision.fp8 (`fp8`: "native" or "emulated" on `device`, as
    `hlat.optim.fp8.fp8_support` says), split, parallelised and initialised (`weights`: how, as
    `hlat.models.materialize` says); one optimizer per part; the pipeline
    schedule that runs them, if any (its stages given their boundaries' `shapes`, or inferring them from the first
    micro-batch)."""
    torch.manual_seed(cfg.train.seed)
    layout, n_stages = topo.cfg, topo.cfg.stages()
    if shapes is None and cfg.model.moe:  # no shape-inference pass, whose backward would count routing figures
        shapes = StageShapes(cfg.train.micro_batch, cfg.train.seq_len, dtypes(cfg.precision.mode)[0])
    model = prepare_model(model, cfg.precision.mode)
    fp8_all_gather = cfg.precision.fp8 == "tensorwise" and layout.shards > 1
    if cfg.precision.fp8 != "none":
        convert_blocks(model, cfg.precision.fp8, fp8 == "emulated", fp8_all_gather)
    stages = parallelize(model, topo, device, cfg.train.seed, weights)
    parts = [module for _, module in stages]
    per_rank = layout.microbatches(cfg.train.global_batch, cfg.train.micro_batch)
    optimizers = [build_optimizer(part, cfg.optim, cfg.precision.mode, cfg.train.seed) for part in parts]
    if fp8_all_gather:
        for optimizer, part in zip(optimizers, parts):
            precompute_scales_after_step(optimizer, part)
    return ModelParts(
        parts=parts,
        optimizers=optimizers,
        schedule=build_schedule(stages, topo, device, per_rank, shapes) if layout.pp > 1 else None,
        first_stage=any(sid == 0 for sid, _ in stages),
        last_stage=any(sid == n_stages - 1 for sid, _ in stages),
        sharded_grads=layout.shards > 1 and not layout.zero1,
        autocast=autocast(cfg.precision.mode, device),
        loss_context=loss_parallel if layout.tp > 1 else contextlib.nullcontext,
    )


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


def check_disk(trainer: Trainer, inputs: RunInputs) -> None:
    """Before the first step: room for the checkpoints the run keeps, against the size of one (refused in one line,
    or a warning when every checkpoint is kept: hlat.checkpoint.run.Checkpoints.check_room), and for the memory
    tier's snapshots (its cost per rank said: `check_memory`)."""
    size = checkpoint_bytes(inputs.resume_from, inputs.n_params, trainer.cfg.precision.mode)
    warning = trainer.checkpoints.check_room(trainer.step, size, local_elements(trainer.model.params))
    for line in (warning, trainer.checkpoints.check_memory()):
        if line:
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


def run_steps(trainer: Trainer) -> None:
    """Steps until `train.steps`, or until a stop signal, after which the run checkpoints and stops."""
    with StopRequest().installed() as stop, trainer.watchdog:
        while trainer.step < trainer.cfg.train.steps:
            result = trainer.train_step(trainer.step, stop.requested, trainer.checkpoints.writes())
            trainer.after_step(result)
            if result.stopping:
                trainer.console.print(
                    f"stopped by signal at step {trainer.step}; checkpoint "
                    f"{trainer.checkpoints.saved}; resume with --resume auto"
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
        first_loss=report.losses[0] if report.losses else float("nan"),
        last_loss=report.losses[-1] if report.losses else float("nan"),
        checkpoint=str(trainer.checkpoints.saved or resume_from or ""),
        ettr=trainer.goodput.ettr(),
        bad_steps=trainer.train_step.bad_steps.total,
        recovery=trainer.goodput.recovery(),
    )
