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
from hlat.data.packing import build_stream
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
from hlat.train.metrics import MetricsLog, peak_flops, peak_memory_gb
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


class Batches:
    """This rank's micro-batches for each step.

    `replicated` data sharding: every rank reads the whole stream and takes micro-batches dp_rank,
    dp_rank + dp, ... of each step's global batch, so every layout trains on exactly the batches a single
    process would and the data position is the same on all ranks (a checkpoint resumes under any layout).
    `files`: each data-parallel rank reads its own files, for clusters where reading everything everywhere
    would cost too much; the data positions are per rank and a resume needs the same data-parallel size."""

    def __init__(self, stream, topo: Topology, global_accum: int):
        self.stream, self.topo, self.global_accum = stream, topo, global_accum
        self.replicated = topo.cfg.data_sharding == "replicated"

    def next_step(self, device: torch.device) -> list[dict]:
        dp, rank = self.topo.cfg.dp, self.topo.dp_rank
        if self.replicated:
            micro = [next(self.stream) for _ in range(self.global_accum)][rank::dp]
        else:
            micro = [next(self.stream) for _ in range(self.global_accum // dp)]
        return [{k: t.to(device, non_blocking=True) for k, t in batch.items()} for batch in micro]

    @property
    def trainer_key(self) -> str:
        return "trainer" if self.replicated else f"trainer_rank{self.topo.rank}"


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
    stream = build_stream(cfg.data, tokenizer, files, tc.seq_len, tc.micro_batch, doc_mask=cfg.model.doc_mask,
                          **({} if pcfg.data_sharding == "replicated"
                             else {"rank": topo.dp_rank, "world_size": pcfg.dp}))
    try:
        return _run(cfg, topo, device, stream, Batches(stream, topo, global_accum), stages, optimizers, resume_from,
                    run_dir, console)
    finally:
        stream.close()  # stops the tokenizer workers


def _run(cfg: Config, topo: Topology, device: torch.device, stream, batches: Batches, stages: list,
         optimizers: list, resume_from: Path | None, run_dir: Path, console: Console) -> Summary:
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
    peak = peak_flops(device, tc.peak_flops) * (dist.get_world_size() if dist.is_initialized() else 1)
    decay_steps = cfg.optim.decay_steps or tc.steps
    losses: list[float] = []
    step, saved = start, None
    run_start = interval_start = time.perf_counter()
    interval_tokens = interval_steps = 0
    interval_loss = torch.zeros((), device=device)
    interval_wait = stream.wait_time_s

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
            interval_tokens += tokens_per_step
            interval_loss += loss
            interval_steps += 1
            if step % tc.log_every == 0 or step in (start + 1, tc.steps) or stopping:
                loss_value = (interval_loss / interval_steps).item()  # mean over the steps since the last log
                now = time.perf_counter()
                tokens_per_s = interval_tokens / (now - interval_start)
                step_time = (now - interval_start) / interval_steps
                record = {
                    "step": step, "loss": loss_value, "grad_norm": grad_norm.item(), "lr": lr,
                    "tokens_seen": step * tokens_per_step, "tokens_per_s": round(tokens_per_s, 1),
                    "step_time_s": round(step_time, 4),
                    "mfu": round(flops_per_token * tokens_per_s / peak, 5) if peak else None,
                    "peak_memory_gb": round(peak_memory_gb(device), 3),
                    "data_wait_s": round(stream.wait_time_s - interval_wait, 4),  # the step waiting for data
                }
                if topo.is_main:
                    metrics.write(record)
                losses.append(loss_value)
                # the first step carries the start-up (data pool, compilation): too early to tell
                eta = "-" if step == start + 1 else format_duration(step_time * (tc.steps - step))
                console.print(f"step {step:>6}/{tc.steps}  loss {loss_value:7.4f}  grad_norm {record['grad_norm']:6.3f}  "
                              f"lr {lr:.2e}  {tokens_per_s:>9,.0f} tok/s  mfu {record['mfu'] or 0:6.2%}  "
                              f"eta {eta}", soft_wrap=True, highlight=False)
                interval_start, interval_tokens, interval_steps = now, 0, 0
                interval_wait = stream.wait_time_s
                interval_loss = torch.zeros((), device=device)
            if (tc.ckpt_every and step % tc.ckpt_every == 0) or step == tc.steps or stopping:
                saved = checkpoint(step)
            if stopping:
                console.print(f"stopped by signal at step {step}; checkpoint {saved}; resume with --resume auto")
                break
    elapsed = time.perf_counter() - run_start
    ran = step - start
    return Summary(run_dir=str(run_dir), steps=step, tokens_seen=step * tokens_per_step,
                   tokens_per_s=ran * tokens_per_step / elapsed if elapsed > 0 else 0.0,
                   first_loss=losses[0] if losses else float("nan"), last_loss=losses[-1] if losses else float("nan"),
                   checkpoint=str(saved or resume_from or ""))
