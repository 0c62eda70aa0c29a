"""The training loop: config in, trained checkpoints and metrics out, on one process or many (torchrun).

Order of work (docs/architecture.md): check the config against the world size, resolve data and device ->
process group and mesh -> tokenizer -> model on meta, split/sharded, materialised and initialised ->
optimizers -> data stream -> restore a checkpoint if resuming -> steps -> checkpoints.
"""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
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
from hlat.train.checkpoint import latest_checkpoint, load_checkpoint, resolve_checkpoint, save_checkpoint
from hlat.train.config import Config
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


def find_resume_checkpoint(cfg: Config) -> Path | None:
    resume = cfg.train.resume
    if not resume:
        if latest_checkpoint(cfg.train.run_dir):  # never overwrite a run's checkpoints by starting afresh
            raise HlatError(f"train.run_dir: {cfg.train.run_dir} already holds checkpoints; continue it with "
                            "--resume auto or choose another --train.run_dir")
        return None
    if resume == "auto":  # continue if there is something to continue from, else start fresh
        return latest_checkpoint(cfg.train.run_dir)
    return resolve_checkpoint(resume)


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


def train(cfg: Config, console: Console | None = None) -> Summary:
    tc = cfg.train
    pcfg = cfg.resolved_parallel()  # every layout error is raised here, before any process group starts
    run_dir = Path(tc.run_dir)
    device = pick_device(tc.device)
    files = resolve_data_files(cfg.data)
    resume_from = find_resume_checkpoint(cfg)
    resume_changes = check_start(cfg, resume_from)  # shapes fit, schedule changes allowed: one-line errors

    topo = init_topology(pcfg, device)
    console = console if topo.is_main and console is not None else Console(quiet=not topo.is_main)
    for change in resume_changes:
        console.print(f"resuming with a changed config: {change}", highlight=False)
    try:
        return _train(cfg, topo, device, files, resume_from, run_dir, console)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: Config, topo: Topology, device: torch.device, files: list[Path], resume_from: Path | None,
           run_dir: Path, console: Console) -> Summary:
    tc, pcfg = cfg.train, topo.cfg
    if topo.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(cfg.run_record(pcfg))
        tokenizer = get_tokenizer(cfg.data, files, cfg.model.vocab_size, run_dir)  # trained once, saved in the run
    if dist.is_initialized():
        dist.barrier()
    if not topo.is_main:
        tokenizer = get_tokenizer(cfg.data, files, cfg.model.vocab_size, run_dir)

    torch.manual_seed(tc.seed)
    model = prepare_model(build_model(cfg.model), cfg.precision.mode)  # still on meta: bf16 before sharding
    stages = parallelize(model, topo, device, tc.seed)
    optimizers = [build_optimizer(module, cfg.optim, cfg.precision.mode, tc.seed) for _, module in stages]
    global_accum = tc.grad_accum()
    stream = open_stream(cfg, topo, tokenizer, files)
    val_batches = (validation_batches(validation_documents(cfg), tokenizer, tc.seq_len, tc.micro_batch,
                                      cfg.eval.batches, cfg.model.doc_mask) if cfg.eval.every else [])
    try:
        return _run(cfg, topo, device, stream, Batches(stream, topo, global_accum), stages, optimizers, resume_from,
                    run_dir, console, val_batches)
    finally:
        stream.close()  # stops the tokenizer workers


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


def _run(cfg: Config, topo: Topology, device: torch.device, stream, batches: Batches, stages: list,
         optimizers: list, resume_from: Path | None, run_dir: Path, console: Console,
         val_batches: list[dict]) -> Summary:
    tc, pcfg = cfg.train, topo.cfg
    parts = [module for _, module in stages]
    params = [p for part in parts for p in part.parameters()]
    accum = batches.global_accum // pcfg.dp
    n_stages = pcfg.stages()
    first_stage = any(sid == 0 for sid, _ in stages)
    last_stage = any(sid == n_stages - 1 for sid, _ in stages)
    schedule = build_schedule(stages, topo, device, accum, cross_entropy) if pcfg.pp > 1 else None
    pp_group = topo.group("pp") if pcfg.pp > 1 else None
    sharded_grads = pcfg.dp_shard > 1 and not pcfg.zero1  # FSDP keeps only its shard of the gradients
    metrics = MetricsLog(run_dir)

    start = 0
    if resume_from is not None:
        state = load_checkpoint(resume_from, parts, optimizers, batches.trainer_key)
        start = state["step"]
        stream.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        if topo.is_main:
            metrics.truncate_after(start)
        console.print(f"resumed from {resume_from} at step {start}")
    else:
        if topo.is_main:
            metrics.truncate_after(-1)
        if tc.init_from:
            load_checkpoint(resolve_checkpoint(tc.init_from), parts)
            console.print(f"initialised weights from {tc.init_from}")

    autocast = precision_autocast(cfg.precision.mode, device)
    loss_context = loss_parallel if pcfg.tp > 1 else contextlib.nullcontext
    tokens_per_step = tc.global_batch * tc.seq_len
    flops_per_token = cfg.model.flops_per_token(tc.seq_len)
    world = dist.get_world_size() if dist.is_initialized() else 1
    peak = peak_flops(device, tc.peak_flops) * world
    decay_steps = cfg.optim.decay_steps or tc.steps
    cost = resolve_cost(cfg.cost, world)
    if cost:
        console.print(f"cost: ${cost.usd_per_device_hour:.4g} per device-hour x {world} devices ({cost.source})",
                      highlight=False)
    elapsed_before = previous_elapsed(metrics) if resume_from is not None else 0.0
    losses: list[float] = []
    step, saved = start, None
    run_start = time.perf_counter()
    interval = Interval(device, stream.wait_time_s)

    def checkpoint(at: int) -> Path:
        trainer_state = {"step": at, "data": stream.state_dict(), "rng": rng_state()}
        return save_checkpoint(run_dir, at, parts, optimizers, trainer_state, batches.trainer_key, cfg.to_toml(),
                               tc.keep_checkpoints, topo.rank)

    def step_loss(micro: list[dict]) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches; the mean loss of those (0 off the last stage)."""
        if schedule is not None:
            inputs = torch.cat([b["inputs"] for b in micro]) if first_stage else None
            targets = torch.cat([b["targets"] for b in micro]) if last_stage else None
            microbatch_losses: list[torch.Tensor] = []
            with autocast, loss_context():
                schedule.step(*([inputs] if first_stage else []), target=targets, losses=microbatch_losses)
            if not last_stage:
                return torch.zeros((), device=device)
            return torch.stack([plain(loss.detach()) for loss in microbatch_losses]).mean()
        total = torch.zeros((), device=device)
        for i, batch in enumerate(micro):
            sync_gradients(parts[0], sharded_grads, last_micro_batch=i == len(micro) - 1)
            targets = batch.pop("targets")
            with loss_context():
                with autocast:
                    logits = parts[0](batch.pop("inputs"), **batch)  # extra keys (positions...) go to the model
                loss = cross_entropy(logits, targets) / accum
                loss.backward()
            total += plain(loss.detach())
        return total

    def reduce_step(local_loss: torch.Tensor, stop_requested: bool) -> tuple[torch.Tensor, bool]:
        """The loss over the global batch (the mean over data-parallel ranks of the last stage's losses;
        tensor-parallel peers hold the same value) and whether any rank was asked to stop: one all-reduce."""
        if not dist.is_initialized():
            return local_loss, stop_requested
        packed = torch.stack([local_loss, torch.tensor(float(stop_requested), device=device)])
        dist.all_reduce(packed)
        return packed[0] / (pcfg.dp * pcfg.tp), bool(packed[1].item())

    n_params = count_params(build_model(cfg.model))
    console.print(f"training {cfg.model.preset or cfg.model.family} ({n_params:,} parameters) on {device}"
                  f"{f' x {dist.get_world_size()} ranks' if dist.is_initialized() else ''}, {tc.steps} steps of "
                  f"{tokens_per_step:,} tokens, run dir {run_dir}", soft_wrap=True, highlight=False)
    with StopRequest().installed() as stop:
        while step < tc.steps:
            lr = lr_at(step, cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps, decay_steps)
            for optimizer in optimizers:
                for group in optimizer.param_groups:
                    group["lr"] = lr
            loss, stopping = reduce_step(step_loss(batches.next_step(device)), stop.requested)
            grad_norm = clip_grad_norm(params, cfg.optim.clip_grad_norm, pp_group)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step += 1
            interval.add(loss, grad_norm)
            validate = bool(cfg.eval.every) and (step % cfg.eval.every == 0 or step == tc.steps)
            if step % tc.log_every == 0 or step in (start + 1, tc.steps) or stopping or validate:
                stats = interval.close(stream.wait_time_s)  # means over the steps since the last log
                tokens_per_s = stats["steps"] * tokens_per_step / stats["seconds"]
                step_time = stats["seconds"] / stats["steps"]
                record = {
                    "step": step, "time": round(time.time(), 3), "loss": stats["loss"],
                    "grad_norm": stats["grad_norm"], "grad_norm_mean": stats["grad_norm_mean"],
                    "grad_norm_max": stats["grad_norm_max"], "lr": lr,
                    "tokens_seen": step * tokens_per_step, "tokens_per_s": round(tokens_per_s, 1),
                    "step_time_s": round(step_time, 4),
                    "mfu": round(flops_per_token * tokens_per_s / peak, 5) if peak else None,
                    "peak_memory_gb": round(peak_memory_gb(device), 3),
                    "data_wait_s": round(stats["data_wait_s"], 4),  # the steps waiting for data
                    **progress_figures(elapsed_before + time.perf_counter() - run_start, step_time, step, tc.steps,
                                       step * tokens_per_step, cost),
                }
                if validate:
                    record.update(validation_figures(evaluate(parts[0], val_batches, device, autocast, loss_context)))
                    interval.reset(stream.wait_time_s)  # the evaluation's time is not a training step's
                if topo.is_main:
                    metrics.write(record)
                losses.append(stats["loss"])
                # the first step carries the start-up (data pool, compilation): too early to tell
                eta = "-" if step == start + 1 else format_duration(step_time * (tc.steps - step))
                spent = f"  ${record['cost_usd']:,.2f}" if cost else ""
                val = f"  val_loss {record['val_loss']:7.4f}" if validate else ""
                console.print(f"step {step:>6}/{tc.steps}  loss {stats['loss']:7.4f}  grad_norm {stats['grad_norm']:6.3f}  "
                              f"lr {lr:.2e}  {tokens_per_s:>9,.0f} tok/s  mfu {record['mfu'] or 0:6.2%}  "
                              f"eta {eta}{spent}{val}", soft_wrap=True, highlight=False)
            if (tc.ckpt_every and step % tc.ckpt_every == 0) or step == tc.steps or stopping:
                saved = checkpoint(step)
            if stopping:
                console.print(f"stopped by signal at step {step}; checkpoint {saved}; resume with --resume auto")
                break
    metrics.close()
    elapsed = time.perf_counter() - run_start
    ran = step - start
    return Summary(run_dir=str(run_dir), steps=step, tokens_seen=step * tokens_per_step,
                   tokens_per_s=ran * tokens_per_step / elapsed if elapsed > 0 else 0.0,
                   first_loss=losses[0] if losses else float("nan"), last_loss=losses[-1] if losses else float("nan"),
                   checkpoint=str(saved or resume_from or ""))
