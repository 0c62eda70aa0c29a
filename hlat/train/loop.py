"""The training loop: config in, trained checkpoints and metrics out.

Order of work (docs/architecture.md): resolve data and device -> tokenizer -> model on meta, materialised and
initialised -> optimizer -> data stream -> restore a checkpoint if resuming -> steps -> checkpoints.
"""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console

from hlat import HlatError
from hlat.data.packing import build_stream
from hlat.data.sources import default_corpus, resolve_paths
from hlat.data.tokenizer import get_tokenizer
from hlat.models import build_model, materialize
from hlat.optim import build_optimizer, lr_at
from hlat.train.checkpoint import latest_checkpoint, load_checkpoint, resolve_checkpoint, save_checkpoint
from hlat.train.config import Config
from hlat.train.metrics import MetricsLog, peak_flops, peak_memory_gb


@dataclass
class Summary:
    run_dir: str
    steps: int
    tokens_seen: int
    tokens_per_s: float
    first_loss: float
    last_loss: float
    checkpoint: str


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise HlatError("train.device: 'cuda' was asked for but no CUDA device is available")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


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
    """SIGTERM/SIGINT ask the loop to checkpoint and stop after the current step instead of dying mid-step."""

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


def train(cfg: Config, console: Console | None = None) -> Summary:
    console = console or Console()
    tc = cfg.train
    run_dir = Path(tc.run_dir)
    device = pick_device(tc.device)
    files = resolve_paths(cfg.data.paths) if cfg.data.paths else default_corpus()
    resume_from = find_resume_checkpoint(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(cfg.to_toml())

    torch.manual_seed(tc.seed)
    tokenizer = get_tokenizer(cfg.data, files, cfg.model.vocab_size, run_dir)
    model = materialize(build_model(cfg.model), device)
    optimizer = build_optimizer(model, cfg.optim)
    stream = build_stream(cfg.data, tokenizer, files, tc.seq_len, tc.micro_batch)
    metrics = MetricsLog(run_dir)

    start = 0
    if resume_from is not None:
        state = load_checkpoint(resume_from, model, optimizer)
        start = state["step"]
        stream.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        metrics.truncate_after(start)
        console.print(f"resumed from {resume_from} at step {start}")
    else:
        metrics.truncate_after(-1)
        if tc.init_from:
            load_checkpoint(resolve_checkpoint(tc.init_from), model)
            console.print(f"initialised weights from {tc.init_from}")

    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.precision.mode == "bf16_mixed"
                else contextlib.nullcontext())
    grad_accum = tc.grad_accum()
    tokens_per_step = tc.global_batch * tc.seq_len
    flops_per_token = cfg.model.flops_per_token(tc.seq_len)
    peak = peak_flops(device, tc.peak_flops)
    decay_steps = cfg.optim.decay_steps or tc.steps
    losses: list[float] = []
    step, saved = start, None
    run_start = interval_start = time.perf_counter()
    interval_tokens = interval_steps = 0
    interval_loss = torch.zeros((), device=device)

    def checkpoint(at: int) -> Path:
        trainer_state = {"step": at, "data": stream.state_dict(), "rng": rng_state()}
        return save_checkpoint(run_dir, at, model, optimizer, trainer_state, cfg.to_toml(), tc.keep_checkpoints)

    console.print(f"training {cfg.model.preset or cfg.model.family} ({sum(p.numel() for p in model.parameters()):,} "
                  f"parameters) on {device}, {tc.steps} steps of {tokens_per_step:,} tokens, run dir {run_dir}",
                  soft_wrap=True, highlight=False)
    with StopRequest().installed() as stop:
        while step < tc.steps:
            lr = lr_at(step, cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps, decay_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for _ in range(grad_accum):
                batch = {k: t.to(device, non_blocking=True) for k, t in next(stream).items()}
                targets = batch.pop("targets")
                with autocast:
                    logits = model(batch.pop("inputs"), **batch)  # extra keys (positions...) go to the model
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) / grad_accum
                loss.backward()
                loss_sum += loss.detach()
            max_norm = cfg.optim.clip_grad_norm or float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            interval_tokens += tokens_per_step
            interval_loss += loss_sum
            interval_steps += 1
            if step % tc.log_every == 0 or step in (start + 1, tc.steps) or stop.requested:
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
                }
                metrics.write(record)
                losses.append(loss_value)
                eta = format_duration(step_time * (tc.steps - step))
                console.print(f"step {step:>6}/{tc.steps}  loss {loss_value:7.4f}  grad_norm {record['grad_norm']:6.3f}  "
                              f"lr {lr:.2e}  {tokens_per_s:>9,.0f} tok/s  mfu {record['mfu'] or 0:6.2%}  eta {eta}",
                              soft_wrap=True, highlight=False)
                interval_start, interval_tokens, interval_steps = now, 0, 0
                interval_loss = torch.zeros((), device=device)
            if (tc.ckpt_every and step % tc.ckpt_every == 0) or step == tc.steps or stop.requested:
                saved = checkpoint(step)
            if stop.requested:
                console.print(f"stopped by signal at step {step}; checkpoint {saved}; resume with --train.resume auto")
                break
    elapsed = time.perf_counter() - run_start
    ran = step - start
    return Summary(run_dir=str(run_dir), steps=step, tokens_seen=step * tokens_per_step,
                   tokens_per_s=ran * tokens_per_step / elapsed if elapsed > 0 else 0.0,
                   first_loss=losses[0] if losses else float("nan"), last_loss=losses[-1] if losses else float("nan"),
                   checkpoint=str(saved or resume_from or ""))
