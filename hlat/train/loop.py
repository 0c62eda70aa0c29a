"""The training loop: config in, trained checkpoints and metrics out, on one process or many (torchrun).

Order of work (docs/architecture.md): check the config against the world size, resolve data and device ->
process group and mesh -> tokenizer -> model on meta, split/sharded, materialised and initialised ->
optimizers -> data stream -> restore a checkpoint if resuming -> steps -> checkpoints. `train` reads in that
order; each piece of work is a named helper below it, sharing the run's state through `Run`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hlat import HlatError
from hlat.data.exchange import side_group
from hlat.data.packing import DataStream, Ranks, build_stream
from hlat.data.sources import resolve_data_files
from hlat.data.tokenizer import get_tokenizer
from hlat.models import build_model, count_params
from hlat.optim import build_optimizer, lr_at
from hlat.optim.precision import autocast as precision_autocast
from hlat.optim.precision import prepare_model
from hlat.parallel import Topology, init_topology, parallelize
from hlat.parallel.data import sync_gradients
from hlat.parallel.device import pick_device
from hlat.parallel.grads import clip_grad_norm
from hlat.parallel.pipeline import build_schedule
from hlat.train.checkpoint import (
    Checkpointer,
    DamagedCheckpoint,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    quarantine,
    resolve_checkpoint,
    verify_checkpoint,
)
from hlat.train.config import Config
from hlat.train.faults import BadSteps, Watchdog, poison_gradients, weights_finite
from hlat.train.goodput import Goodput
from hlat.train.inference import Evaluation, evaluate, validation_batches, validation_documents
from hlat.train.metrics import Cost, Interval, MetricsLog, peak_flops, peak_memory_gb, projected_seconds, resolve_cost
from hlat.train.resume import check_start


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


def find_resume_checkpoint(cfg: Config) -> tuple[Path | None, list[DamagedCheckpoint]]:
    """The checkpoint to resume from, and the damaged checkpoints passed over to find it.

    `--resume auto` takes the newest checkpoint that verifies against its manifest (none: start fresh if the
    run has no checkpoint at all); a checkpoint named explicitly is verified and refused if damaged."""
    resume = cfg.train.resume
    if not resume:
        if latest_checkpoint(cfg.train.run_dir):  # never overwrite a run's checkpoints by starting afresh
            raise HlatError(f"train.run_dir: {cfg.train.run_dir} already holds checkpoints; continue it with "
                            "--resume auto or choose another --train.run_dir")
        return None, []
    if resume != "auto":
        path = resolve_checkpoint(resume)
        try:
            verify_checkpoint(path)
        except DamagedCheckpoint as e:
            raise HlatError(f"{e}; refusing to resume from it (--resume auto falls back to the previous good "
                            "checkpoint)") from None
        return path, []
    passed_over = []
    for _, path in reversed(complete_checkpoints(cfg.train.run_dir)):
        try:
            verify_checkpoint(path)
            return path, passed_over
        except DamagedCheckpoint as e:
            passed_over.append(e)
    if passed_over:
        raise HlatError(f"train.run_dir: {cfg.train.run_dir}: every checkpoint is damaged ({passed_over[0]})")
    return None, []


def rng_state() -> dict:
    return {"cpu": torch.get_rng_state().tolist(),
            "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["cpu"], dtype=torch.uint8))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class StopRequest:
    """SIGTERM/SIGINT ask the loop to checkpoint and stop after the current step instead of dying mid-step;
    ranks agree on it each step (with the loss, see `reduce_step`), so they all save the same step."""

    def __init__(self):
        self.requested = False

    @contextlib.contextmanager
    def installed(self):
        def handler(signum, frame):
            self.requested = True

        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token loss in fp32; logits may be a vocabulary-sharded DTensor (under loss_parallel)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def plain(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor on `device`; from pinned host memory off the CPU, so the copy does not wait for the
    device's queued work (a copy from pageable memory would)."""
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


class Batches:
    """This rank's micro-batches for each step, which its stream gives it (docs/data.md).

    `global` data sharding: every rank's stream is a part of the one global stream, so that each rank trains on
    micro-batches dp_rank, dp_rank + dp, ... of each step's global batch (those a single process would run) and
    the data state is the same on all ranks: one copy in the checkpoint, which resumes under any layout.
    `files`: each data-parallel rank reads its own files, for storage that cannot serve every rank all the data;
    the data states are per rank and a resume needs the same data-parallel size."""

    def __init__(self, stream, topo: Topology, global_accum: int):
        self.stream, self.topo, self.global_accum = stream, topo, global_accum
        self.shared = topo.cfg.data_sharding == "global"

    def next_step(self, device: torch.device) -> list[dict]:
        micro = [next(self.stream) for _ in range(self.global_accum // self.topo.cfg.dp)]
        return [{k: to_device(t, device) for k, t in batch.items()} for batch in micro]

    @property
    def trainer_key(self) -> str:
        return "trainer" if self.shared else f"trainer_rank{self.topo.rank}"


def open_stream(cfg: Config, topo: Topology, tokenizer, files: list[Path]) -> DataStream:
    """This rank's data stream: its part of the global stream, shared with all ranks over a CPU side group, or
    (data_sharding = "files") a stream of its data-parallel rank's own files."""
    tc, pcfg = cfg.train, topo.cfg
    args = (cfg.data, tokenizer, files, tc.seq_len, tc.micro_batch)
    # documents held out for validation (a hash split, when no eval.paths are given) are skipped in training
    common = dict(doc_mask=cfg.model.doc_mask, holdout=0.0 if cfg.eval.paths else cfg.eval.holdout)
    if pcfg.data_sharding == "files":
        return build_stream(*args, shard=(topo.dp_rank, pcfg.dp), **common)
    ranks = Ranks(side_group(), topo.dp_rank, pcfg.dp, tc.grad_accum())
    return build_stream(*args, ranks=ranks, **common)


@dataclass
class Run:
    """What the step, checkpoint and logging helpers need of a run: built once by `train`, read by them all."""
    cfg: Config
    topo: Topology
    device: torch.device
    run_dir: Path
    stream: object  # the data stream (hlat.data.packing): batches, a resumable position and the data wait time
    batches: Batches
    parts: list[nn.Module]  # the model parts (pipeline stages) this rank holds
    optimizers: list[torch.optim.Optimizer]
    checkpointer: Checkpointer
    schedule: object | None  # the pipeline schedule, if pp > 1
    pp_group: dist.ProcessGroup | None  # the pipeline group, if pp > 1 (gradient norms sum over stages)
    first_stage: bool
    last_stage: bool
    sharded_grads: bool  # FSDP keeps only its shard of the gradients
    autocast: object
    loss_context: object

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    @property
    def accum(self) -> int:
        """Micro-batches this rank runs per step."""
        return self.batches.global_accum // self.topo.cfg.dp


def train(cfg: Config, console: Console | None = None) -> Summary:
    """Train `cfg` to `train.steps` on this process (one rank of a torchrun job, or the only one)."""
    entered = time.time()
    tc = cfg.train
    pcfg = cfg.resolved_parallel()  # every layout error is raised here, before any process group starts
    run_dir = Path(tc.run_dir)
    device = pick_device(tc.device)
    files = resolve_data_files(cfg.data)
    resume_from, passed_over = find_resume_checkpoint(cfg)
    resume_changes = check_start(cfg, resume_from)  # shapes fit, schedule changes allowed: one-line errors

    if device.type == "cuda":
        enable_flight_recorder(run_dir)
    topo = init_topology(pcfg, device, tc.collective_timeout_s)
    console = console if topo.is_main and console is not None else Console(quiet=not topo.is_main)
    for change in resume_changes:
        console.print(f"resuming with a changed config: {change}", highlight=False)
    for damaged in passed_over:  # set aside, so that rotation counts only good checkpoints
        console.print(f"{damaged}; falling back to the previous checkpoint", soft_wrap=True, highlight=False,
                      markup=False)
        if topo.is_main:
            quarantine(damaged.path)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(destroy_process_group)
        tokenizer = prepare_run_dir(cfg, topo, files, run_dir)
        goodput = Goodput(run_dir, topo.is_main, entered)
        torch.manual_seed(tc.seed)
        model = prepare_model(build_model(cfg.model), cfg.precision.mode)  # still on meta: bf16 before sharding
        stages = parallelize(model, topo, device, tc.seed)
        optimizers = [build_optimizer(module, cfg.optim, cfg.precision.mode, tc.seed) for _, module in stages]
        stream = open_stream(cfg, topo, tokenizer, files)
        cleanup.callback(stream.close)  # stops the tokenizer workers
        val_batches = (validation_batches(validation_documents(cfg), tokenizer, tc.seq_len, tc.micro_batch,
                                          cfg.eval.batches, cfg.model.doc_mask) if cfg.eval.every else [])
        run = build_run(cfg, topo, device, run_dir, stream, stages, optimizers)
        cleanup.callback(run.checkpointer.close)
        metrics = MetricsLog(run_dir)
        cleanup.callback(metrics.close)
        start = restore(run, resume_from, metrics, console)

        tokens_per_step = tc.global_batch * tc.seq_len
        decay_steps = cfg.optim.decay_steps or tc.steps
        world = dist.get_world_size() if dist.is_initialized() else 1
        cost = resolve_cost(cfg.cost, world)
        if cost:
            console.print(f"cost: ${cost.usd_per_device_hour:.4g} per device-hour x {world} devices ({cost.source})",
                          highlight=False)
        elapsed_before = previous_elapsed(metrics) if resume_from is not None else 0.0
        losses: list[float] = []
        step, saved = start, None
        run_start = time.perf_counter()
        interval = Interval(device, stream.wait_time_s)
        announce(run, tokens_per_step, console)
        bad = BadSteps(tc.spike_sigmas, tc.max_bad_steps)
        watchdog = Watchdog(tc.hang_timeout_s, run_dir, topo.rank,
                            dist.get_world_size() if dist.is_initialized() else 1)
        goodput.start_up_done()
        with StopRequest().installed() as stop, watchdog:
            while step < tc.steps:
                step_started, waited = time.perf_counter(), stream.wait_time_s
                lr = lr_at(step, cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps, decay_steps)
                set_lr(run.optimizers, lr)
                local_loss = step_loss(run, run.batches.next_step(device))
                if step + 1 == tc.debug_nan_step and not bad.injected:
                    local_loss = inject_nan(run, local_loss, bad)
                loss, stopping, save_written = reduce_step(run, local_loss, stop.requested, run.checkpointer.written())
                if save_written:  # an asynchronous save is on disk on every rank: commit it
                    saved = commit(run, goodput)
                grad_norm = clip_grad_norm(run.params, cfg.optim.clip_grad_norm, run.pp_group)
                # skipping the update is the host's decision: one transfer brings both figures (not two)
                reason = bad.check(*torch.stack([loss.float(), grad_norm.float().to(loss.device)]).tolist())
                for optimizer in run.optimizers:
                    if reason is None:
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                goodput.step(step + 1, time.perf_counter() - step_started, stream.wait_time_s - waited,
                             bad=reason is not None)
                if reason is not None and (rolled_back_to := handle_bad_step(run, bad, reason, step + 1, metrics,
                                                                               console)) is not None:
                    step = rolled_back_to
                    interval.reset(stream.wait_time_s)
                    goodput.lose_pending()
                    watchdog.beat(step)
                    continue
                step += 1
                interval.add(loss, grad_norm)
                validate = bool(cfg.eval.every) and (step % cfg.eval.every == 0 or step == tc.steps)
                if step % tc.log_every == 0 or step in (start + 1, tc.steps) or stopping or validate:
                    elapsed = elapsed_before + time.perf_counter() - run_start
                    losses.append(log_step(run, metrics, interval, step, start, lr, bad.total, elapsed, cost,
                                           val_batches if validate else None, console))
                    goodput.save()
                if (tc.ckpt_every and step % tc.ckpt_every == 0) or step == tc.steps or stopping:
                    saved = checkpoint(run, step, goodput, commit_now=stopping) or saved
                watchdog.beat(step)
                if stopping:
                    console.print(f"stopped by signal at step {step}; checkpoint {saved}; resume with --resume auto")
                    break
        saved = commit(run, goodput) or saved
        elapsed = time.perf_counter() - run_start
        ran = step - start
        return Summary(run_dir=str(run_dir), steps=step, tokens_seen=step * tokens_per_step,
                       tokens_per_s=ran * tokens_per_step / elapsed if elapsed > 0 else 0.0,
                       first_loss=losses[0] if losses else float("nan"),
                       last_loss=losses[-1] if losses else float("nan"),
                       checkpoint=str(saved or resume_from or ""), ettr=goodput.ettr(),
                       bad_steps=bad.total)


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


def prepare_run_dir(cfg: Config, topo: Topology, files: list[Path], run_dir: Path):
    """Rank 0 creates the run directory, writes the config and trains the tokenizer (once, saved in the run);
    the other ranks then load that tokenizer. Returns the tokenizer."""
    if topo.is_main:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.toml").write_text(cfg.run_record(topo.cfg))
        except OSError as e:
            raise HlatError(f"train.run_dir: cannot write {e.filename or run_dir}: {e.strerror}") from None
        tokenizer = get_tokenizer(cfg.data, files, cfg.model.vocab_size, run_dir)
    if dist.is_initialized():
        dist.barrier()
    if not topo.is_main:
        tokenizer = get_tokenizer(cfg.data, files, cfg.model.vocab_size, run_dir)
    return tokenizer


def build_run(cfg: Config, topo: Topology, device: torch.device, run_dir: Path, stream, stages: list,
              optimizers: list) -> Run:
    pcfg = topo.cfg
    batches = Batches(stream, topo, cfg.train.grad_accum())
    n_stages = pcfg.stages()
    schedule = (build_schedule(stages, topo, device, batches.global_accum // pcfg.dp, cross_entropy)
                if pcfg.pp > 1 else None)
    return Run(cfg=cfg, topo=topo, device=device, run_dir=run_dir, stream=stream, batches=batches,
               parts=[module for _, module in stages], optimizers=optimizers, schedule=schedule,
               checkpointer=Checkpointer(run_dir, cfg.train.keep_checkpoints, topo.rank, cfg.train.async_checkpoint,
                                         pinned=device.type == "cuda"),
               pp_group=topo.group("pp") if pcfg.pp > 1 else None,
               first_stage=any(sid == 0 for sid, _ in stages),
               last_stage=any(sid == n_stages - 1 for sid, _ in stages),
               sharded_grads=pcfg.dp_shard > 1 and not pcfg.zero1,
               autocast=precision_autocast(cfg.precision.mode, device),
               loss_context=loss_parallel if pcfg.tp > 1 else contextlib.nullcontext)


def restore(run: Run, resume_from: Path | None, metrics: MetricsLog, console: Console) -> int:
    """Load the checkpoint to resume from (or the initial weights of a fresh run); return the step to start at.
    Metrics past that step are dropped: those steps are about to be run again."""
    if resume_from is not None:
        state = load_checkpoint(resume_from, run.parts, run.optimizers, run.batches.trainer_key)
        run.stream.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        if run.topo.is_main:
            metrics.truncate_after(state["step"])
        console.print(f"resumed from {resume_from} at step {state['step']}", soft_wrap=True, highlight=False)
        return state["step"]
    if run.topo.is_main:
        metrics.truncate_after(-1)
    if run.cfg.train.init_from:
        load_checkpoint(resolve_checkpoint(run.cfg.train.init_from), run.parts)
        console.print(f"initialised weights from {run.cfg.train.init_from}")
    return 0


def announce(run: Run, tokens_per_step: int, console: Console) -> None:
    cfg = run.cfg
    n_params = count_params(build_model(cfg.model))
    console.print(f"training {cfg.model.preset or cfg.model.family} ({n_params:,} parameters) on {run.device}"
                  f"{f' x {dist.get_world_size()} ranks' if dist.is_initialized() else ''}, {cfg.train.steps} steps "
                  f"of {tokens_per_step:,} tokens, run dir {run.run_dir}", soft_wrap=True, highlight=False)


def set_lr(optimizers: list[torch.optim.Optimizer], lr: float) -> None:
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr


def step_loss(run: Run, micro: list[dict]) -> torch.Tensor:
    """Forward and backward over this rank's micro-batches; the mean loss of those (0 off the last stage)."""
    if run.schedule is not None:
        inputs = torch.cat([b["inputs"] for b in micro]) if run.first_stage else None
        targets = torch.cat([b["targets"] for b in micro]) if run.last_stage else None
        microbatch_losses: list[torch.Tensor] = []
        with run.autocast, run.loss_context():
            run.schedule.step(*([inputs] if run.first_stage else []), target=targets, losses=microbatch_losses)
        if not run.last_stage:
            return torch.zeros((), device=run.device)
        return torch.stack([plain(loss.detach()) for loss in microbatch_losses]).mean()
    total = torch.zeros((), device=run.device)
    for i, batch in enumerate(micro):
        sync_gradients(run.parts[0], run.sharded_grads, last_micro_batch=i == len(micro) - 1)
        targets = batch.pop("targets")
        with run.loss_context():
            with run.autocast:
                logits = run.parts[0](batch.pop("inputs"), **batch)  # extra keys (positions...) go to the model
            loss = cross_entropy(logits, targets) / run.accum
            loss.backward()
        total += plain(loss.detach())
    return total


def reduce_step(run: Run, local_loss: torch.Tensor, stop_requested: bool, save_written: bool
                ) -> tuple[torch.Tensor, bool, bool]:
    """The loss over the global batch (the mean over data-parallel ranks of the last stage's losses;
    tensor-parallel peers hold the same value), whether any rank was asked to stop, and whether every rank has
    written its part of the asynchronous save in flight: one all-reduce."""
    if not dist.is_initialized():
        return local_loss, stop_requested, save_written
    flags = torch.tensor([float(stop_requested), float(save_written)], device=run.device)
    packed = torch.cat([local_loss.reshape(1), flags])
    dist.all_reduce(packed)
    stop, written = packed[1:].tolist()
    return packed[0] / (run.topo.cfg.dp * run.topo.cfg.tp), stop > 0, written == dist.get_world_size()


def inject_nan(run: Run, local_loss: torch.Tensor, bad: BadSteps) -> torch.Tensor:
    """train.debug_nan_step: this step's gradients and loss become NaN, once per process (a rollback that
    runs the step number again trains on)."""
    bad.injected = True
    poison_gradients(run.params)
    return local_loss * float("nan")


def handle_bad_step(run: Run, bad: BadSteps, reason: str, step: int, metrics: MetricsLog,
                    console: Console) -> int | None:
    """Apply train.on_bad_step to a bad step whose update was dropped: None to go on (skip), the step of the
    checkpoint rolled back to (rollback), or a one-line HlatError (stop, or too many bad steps in a row)."""
    tc = run.cfg.train
    run.checkpointer.finish()  # a save in flight holds good weights from before this step
    last = latest_checkpoint(run.run_dir)
    if tc.on_bad_step == "stop" or bad.in_a_row >= tc.max_bad_steps:
        why = ("train.on_bad_step = 'stop'" if tc.on_bad_step == "stop"
               else f"{bad.in_a_row} bad steps in a row, train.max_bad_steps = {tc.max_bad_steps}")
        raise HlatError(f"step {step}: {reason}; stopped ({why}); last good checkpoint: {last or 'none'}")
    if tc.on_bad_step == "skip":
        console.print(f"step {step}: {reason}: update skipped ({bad.total} skipped so far)", highlight=False)
        return None
    if last is None:
        raise HlatError(f"step {step}: {reason}; no checkpoint to roll back to yet (train.on_bad_step = "
                        "'rollback'; save one earlier with train.ckpt_every)")
    at = load_checkpoint(last, run.parts, run.optimizers, run.batches.trainer_key)["step"]
    if run.topo.is_main:  # the data stream and RNG go on: the batches since the checkpoint are skipped
        metrics.truncate_after(at)
    console.print(f"step {step}: {reason}: rolled back to {last} (step {at}); the data since then is skipped",
                  soft_wrap=True, highlight=False)
    return at


def log_step(run: Run, metrics: MetricsLog, interval: Interval, step: int, start: int, lr: float, bad_steps: int,
             elapsed_s: float, cost: Cost | None, val_batches: list[dict] | None, console: Console) -> float:
    """Write the metrics record for the steps since the last log (with the validation loss when `val_batches`
    are given) and print its line; return its mean loss."""
    tc, device = run.cfg.train, run.device
    tokens_per_step = tc.global_batch * tc.seq_len
    stats = interval.close(run.stream.wait_time_s)  # means over the steps since the last log
    tokens_per_s = stats["steps"] * tokens_per_step / stats["seconds"]
    step_time = stats["seconds"] / stats["steps"]
    peak = peak_flops(device, tc.peak_flops) * (dist.get_world_size() if dist.is_initialized() else 1)
    flops_per_token = run.cfg.model.flops_per_token(tc.seq_len)
    record = {
        "step": step, "time": round(time.time(), 3), "loss": stats["loss"],
        "grad_norm": stats["grad_norm"], "grad_norm_mean": stats["grad_norm_mean"],
        "grad_norm_max": stats["grad_norm_max"], "lr": lr,
        "tokens_seen": step * tokens_per_step, "tokens_per_s": round(tokens_per_s, 1),
        "step_time_s": round(step_time, 4),
        "mfu": round(flops_per_token * tokens_per_s / peak, 5) if peak else None,
        "peak_memory_gb": round(peak_memory_gb(device), 3),
        "data_wait_s": round(stats["data_wait_s"], 4),  # the steps waiting for data
        "bad_steps": bad_steps,  # dropped updates so far in this process (train.on_bad_step)
        **progress_figures(elapsed_s, step_time, step, tc.steps, step * tokens_per_step, cost),
    }
    if val_batches is not None:
        record.update(validation_figures(evaluate(run.parts[0], val_batches, device, run.autocast,
                                                  run.loss_context)))
        interval.reset(run.stream.wait_time_s)  # the evaluation's time is not a training step's
    if run.topo.is_main:
        metrics.write(record)
    # the first step carries the start-up (data pool, compilation): too early to tell
    eta = "-" if step == start + 1 else format_duration(step_time * (tc.steps - step))
    spent = f"  ${record['cost_usd']:,.2f}" if cost else ""
    val = f"  val_loss {record['val_loss']:7.4f}" if val_batches is not None else ""
    console.print(f"step {step:>6}/{tc.steps}  loss {stats['loss']:7.4f}  grad_norm {stats['grad_norm']:6.3f}  "
                  f"lr {lr:.2e}  {tokens_per_s:>9,.0f} tok/s  mfu {record['mfu'] or 0:6.2%}  "
                  f"eta {eta}{spent}{val}", soft_wrap=True, highlight=False)
    return stats["loss"]


def checkpoint(run: Run, step: int, goodput: Goodput, commit_now: bool) -> Path | None:
    """Save at `step`: training stalls for the whole write, or (asynchronous) for the copy to host memory;
    `commit_now` waits for an asynchronous write too. Returns the checkpoint once committed, else None."""
    started = time.perf_counter()
    saved = save(run, step)
    goodput.checkpointed(time.perf_counter() - started)
    if saved is None and commit_now:
        return commit(run, goodput)
    if saved is not None:
        goodput.committed()
    return saved


def commit(run: Run, goodput: Goodput) -> Path | None:
    """Commit the asynchronous save in flight, if any (a collective: every rank at the same step)."""
    saved = run.checkpointer.finish()
    if saved is not None:
        goodput.committed()
    return saved


def save(run: Run, step: int) -> Path | None:
    """Checkpoint the model, optimizers and trainer state (step, data position, RNG) at `step`; never from
    non-finite weights (they would replace a good checkpoint). None while an asynchronous save is written."""
    if not weights_finite(run.params):
        raise HlatError(f"step {step}: the weights are not finite; not checkpointing them; last good checkpoint: "
                        f"{latest_checkpoint(run.run_dir) or 'none'}")
    trainer_state = {"step": step, "data": run.stream.state_dict(), "rng": rng_state()}
    return run.checkpointer.save(step, run.parts, run.optimizers, trainer_state, run.batches.trainer_key,
                                 run.cfg.to_toml())


def previous_elapsed(metrics: MetricsLog) -> float:
    """Training wall time of the run's earlier segments (before a resume), from its last kept record."""
    records = metrics.records()
    return float(records[-1].get("elapsed_s") or 0.0) if records else 0.0


def progress_figures(elapsed_s: float, step_time_s: float, step: int, total_steps: int, tokens_seen: int,
                     cost: Cost | None) -> dict:
    """Wall time so far and projected for the whole run, and with a price, what both cost."""
    projected = projected_seconds(elapsed_s, step_time_s, step, total_steps)
    figures = {"elapsed_s": round(elapsed_s, 3), "projected_time_s": round(projected, 3)}
    return {**figures, **(cost.figures(elapsed_s, tokens_seen, projected) if cost else {})}


def validation_figures(result: Evaluation) -> dict:
    return {"val_loss": result.loss, "val_perplexity": result.perplexity, "val_tokens": result.tokens}
