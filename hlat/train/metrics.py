"""Per-step metrics: loss, gradient-norm statistics, throughput, MFU, peak memory and cost, printed, appended to
`<run>/metrics.jsonl` and written as TensorBoard event files in the same directory (`tensorboard --logdir runs`)."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn

from hlat.config.job import Config, CostConfig
from hlat.files import append_text, read_metrics, write_text, writing
from hlat.models.moe import routing_table
from hlat.profiles import load_profile
from hlat.train.recovery import PARTS
from hlat.train.tracking import numeric, open_trackers

# Peak dense bf16 FLOP/s per device (vendor figures; dense, no sparsity). CPUs get a nominal figure (cores x
# 2.5 GHz x fp32 FLOP/cycle of two FMA units: 64 with AVX-512, 32 with AVX2), only to make CPU MFU comparable.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}


def peak_flops(device: torch.device, configured: float) -> float:
    if configured:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in PEAK_FLOPS.items() if k in name), 0.0)
    return (os.cpu_count() or 1) * 2.5e9 * (64 if _has_avx512() else 32)


def _has_avx512() -> bool:
    try:
        return "avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def peak_memory_bytes(device: torch.device) -> int:
    """The accelerator allocator's peak, or on the CPU the whole process's peak resident memory."""
    if device.type != "cpu":
        return torch.accelerator.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


class Interval:
    """The steps since the last log line: their loss and gradient norm, as each step read them from the device with
    its bad-step decision (`hlat.train.step.TrainStep`), summed here on the host; logging reads nothing more from
    the device. Its seconds are the steps' own (`StepResult.seconds`): a checkpoint's stall, a validation and the
    logging itself between them are not a step's time (they are goodput.json's)."""

    def __init__(self, data_wait_s: float = 0.0):
        self.reset(data_wait_s)

    def reset(self, data_wait_s: float) -> None:
        self.seconds, self.steps, self.data_wait_s = 0.0, 0, data_wait_s
        self.loss_sum = self.norm_sum = self.norm_max = self.norm_last = 0.0

    def add(self, loss: float, grad_norm: float, seconds: float) -> None:
        self.loss_sum += loss
        self.norm_sum += grad_norm
        if math.isnan(grad_norm) or grad_norm > self.norm_max:  # a NaN, once in, stays the maximum
            self.norm_max = grad_norm
        self.norm_last = grad_norm
        self.steps += 1
        self.seconds += seconds

    def close(self, data_wait_s: float) -> dict:
        """{loss (mean), grad_norm (last step's), grad_norm_mean, grad_norm_max, seconds, data_wait_s}; resets."""
        out = {
            "loss": self.loss_sum / self.steps,
            "grad_norm": self.norm_last,
            "grad_norm_mean": self.norm_sum / self.steps,
            "grad_norm_max": self.norm_max,
            "seconds": self.seconds,
            "steps": self.steps,
            "data_wait_s": data_wait_s - self.data_wait_s,
        }
        self.reset(data_wait_s)
        return out


@dataclass
class Cost:
    """What the run's devices cost: a price per device-hour times the number of devices times wall time."""

    usd_per_device_hour: float
    devices: int
    source: str  # where the price came from, for the start-up line

    def figures(self, elapsed_s: float, tokens_seen: int, projected_s: float) -> dict:
        usd = self.usd_per_device_hour * self.devices / 3600.0
        spent = usd * elapsed_s
        return {
            "cost_usd": round(spent, 6),
            "tokens_per_usd": round(tokens_seen / spent, 1) if spent > 0 else None,
            "projected_cost_usd": round(usd * projected_s, 6),
        }


def resolve_cost(cfg: CostConfig, devices: int) -> Cost | None:
    """The run's price: cost.price_per_device_hour, else the hardware profile's node price over its devices per
    node (CostConfig.validate checked that it has one); None when neither is set."""
    if cfg.price_per_device_hour:
        return Cost(cfg.price_per_device_hour, devices, f"cost.price_per_device_hour = {cfg.price_per_device_hour}")
    if not cfg.hardware:
        return None
    profile = load_profile(cfg.hardware)
    node_price = profile.price(cfg.pricing)
    per_device = node_price / profile.devices_per_node
    return Cost(
        per_device,
        devices,
        f"{profile.name} {cfg.pricing}: ${node_price}/node-hour over {profile.devices_per_node} devices",
    )


def projected_seconds(elapsed_s: float, step_time_s: float, step: int, total_steps: int) -> float:
    """The whole run's wall time: what has elapsed plus the remaining steps at the latest step time."""
    return elapsed_s + step_time_s * (total_steps - step)


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def json_safe(value):
    """NaN and infinities become null, so every line of metrics.jsonl is valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    """Appends one JSON object per logged step to metrics.jsonl (kept across resumes) and, on the main rank,
    the same scalars to TensorBoard event files in the run directory, and the same records to the experiment
    trackers given (hlat.train.tracking)."""

    def __init__(self, run_dir: str | Path, trackers: list | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._writer = None
        self.trackers = trackers or []

    def records(self) -> list[dict]:
        return read_metrics(self.path) if self.path.exists() else []

    def truncate_after(self, step: int) -> None:
        """On resume, drop records past the checkpoint's step: those steps are about to be run again."""
        if self.path.exists():
            kept = [record for record in self.records() if record["step"] <= step]
            write_text(self.path, "".join(json.dumps(record) + "\n" for record in kept), self.run_dir)

    def write(self, record: dict) -> None:
        record = {k: json_safe(v) for k, v in record.items()}
        append_text(self.path, json.dumps(record) + "\n", self.run_dir)
        with writing(self.run_dir, self.run_dir, "TensorBoard events in "):  # written (and failing) in a thread
            self._tensorboard(record)
        with writing(self.run_dir, self.run_dir, "tracking records in "):
            for tracker in self.trackers:
                tracker.log(record)

    def _tensorboard(self, record: dict) -> None:
        step, wall = record["step"], record.get("time")
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # TensorBoard hides the events an earlier segment of the run wrote from this step on (a resume)
            self._writer = SummaryWriter(log_dir=str(self.run_dir), purge_step=step)
        for key, value in numeric(record).items():
            self._writer.add_scalar(tensorboard_tag(key), value, step, walltime=wall)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            with writing(self.run_dir, self.run_dir, "TensorBoard events in "):
                writer.close()
        trackers, self.trackers = self.trackers, []
        with writing(self.run_dir, self.run_dir, "tracking records in "):
            for tracker in trackers:
                tracker.close()


def tensorboard_tag(key: str) -> str:
    """A record field's TensorBoard tag: grouped with related curves; a named validation set's under eval/, the
    data mix's under data_mix/."""
    if key in TENSORBOARD_TAGS:
        return TENSORBOARD_TAGS[key]
    for prefix, group in (("val_", "eval"), ("mix_", "data_mix"), ("moe_", "moe")):
        if key.startswith(prefix):
            return f"{group}/{key.removeprefix(prefix)}"
    return f"other/{key}"


# Grouped so TensorBoard shows related curves together.
TENSORBOARD_TAGS = {
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "grad_norm_mean": "train/grad_norm_mean",
    "grad_norm_max": "train/grad_norm_max",
    "lr": "train/lr",
    "val_loss": "eval/loss",
    "val_perplexity": "eval/perplexity",
    "val_tokens": "eval/tokens",
    "tokens_seen": "progress/tokens_seen",
    "elapsed_s": "progress/elapsed_s",
    "projected_time_s": "progress/projected_time_s",
    "tokens_per_s": "speed/tokens_per_s",
    "step_time_s": "speed/step_time_s",
    "mfu": "speed/mfu",
    "data_wait_s": "speed/data_wait_s",
    "peak_memory_gb": "memory/peak_gb",
    "cost_usd": "cost/usd",
    "tokens_per_usd": "cost/tokens_per_usd",
    "projected_cost_usd": "cost/projected_usd",
    "rank_compute_s": "health/rank_compute_s",
    "rank_compute_max_s": "health/rank_compute_max_s",
    "slowest_rank": "health/slowest_rank",
    "slowest_rank_ratio": "health/slowest_rank_ratio",
    "collective_wait_s": "health/collective_wait_s",
    "collective_wait_max_s": "health/collective_wait_max_s",
    "ettr": "goodput/ettr",
    "failures": "goodput/failures",
    "failures_not_observed": "goodput/failures_not_observed",
    **{f"failure_{part}": f"goodput/failure_{part}" for part in PARTS},
}


MIX_EVERY = 10  # records between console lines that show the data mix (the first and the last show it too)


def mix_figures(mix: dict[str, tuple[float, int]], before: dict[str, int]) -> dict:
    """With several data sources, each one's share of the token positions trained on: its target (its weight's
    share), over the interval since `before` (each source's positions then) and over the run; and its positions."""
    if len(mix) < 2:
        return {}
    interval = sum(tokens for _, tokens in mix.values()) - sum(before.values())
    run = sum(tokens for _, tokens in mix.values())
    out = {}
    for name, (target, tokens) in mix.items():
        out |= {
            f"mix_{name}_target": round(target, 6),
            f"mix_{name}_tokens": tokens,
            f"mix_{name}_interval": (tokens - before[name]) / interval if interval else None,
            f"mix_{name}_run": tokens / run if run else None,
        }
    return out


def mix_text(record: dict) -> str:
    """'  mix run/target: kjv 30.2%/30.0%, shakespeare 69.8%/70.0%' from a record's mix fields ('' without)."""
    names = [
        k.removeprefix("mix_").removesuffix("_target") for k in record if k.startswith("mix_") and k.endswith("_target")
    ]
    shares = ", ".join(f"{n} {record[f'mix_{n}_run'] or 0:.1%}/{record[f'mix_{n}_target']:.1%}" for n in names)
    return f"  mix run/target: {shares}" if names else ""


def routing_figures(parts: list[nn.Module]) -> dict:
    """A mixture of experts' routing over the steps since the last record, summed over every rank (a collective:
    every rank calls it), or {} for a dense model: each layer's choices per expert (`moe_tokens_per_expert`, before
    any is dropped), how far its busiest expert is above an even share (`moe_imbalance_layerN`: 1 is even, and
    `moe_imbalance` the worst layer's), the share of the choices dropped past an expert's capacity (`moe_dropped`),
    and the load-balancing loss, averaged over layers and micro-batches (`moe_aux_loss`)."""
    table = routing_table(parts)
    if table is None:
        return {}
    if dist.is_initialized():
        dist.all_reduce(table)
    rows = table.tolist()
    tokens = [[round(share) for share in row[:-3]] for row in rows]
    imbalance = [max(row) * len(row) / sum(row) if sum(row) else 1.0 for row in tokens]
    routed, aux = sum(map(sum, tokens)), [row[-2] / row[-1] for row in rows if row[-1]]
    return {
        "moe_imbalance": round(max(imbalance), 4),
        **{f"moe_imbalance_layer{i}": round(value, 4) for i, value in enumerate(imbalance)},
        "moe_dropped": round(sum(row[-3] for row in rows) / routed, 6) if routed else 0.0,
        "moe_aux_loss": sum(aux) / len(aux) if aux else None,
        "moe_tokens_per_expert": tokens,
    }


class StepReport:
    """The run's metrics as it trains: each step's loss and gradient norm added up (`Interval`); every
    `train.log_every` steps, and at the first and last step, a stop and a validation, one record to
    metrics.jsonl, TensorBoard and the experiment trackers (main rank) and one console line."""

    def __init__(self, cfg: Config, device: torch.device, devices: int, is_main: bool, console: Console):
        self.cfg, self.device, self.is_main, self.console = cfg, device, is_main, console
        settings = cfg.train
        self.tokens_per_step = settings.tokens_per_step
        self.peak = peak_flops(device, settings.peak_flops) * devices
        self.flops_per_token = cfg.model.flops_per_token(settings.seq_len)
        self.cost = resolve_cost(cfg.cost, devices)
        self.metrics = MetricsLog(settings.run_dir, open_trackers(cfg) if is_main else [])
        self.losses: list[float] = []  # the mean loss of each record written by this process

    def begin(self, step: int, resumed: bool, stream) -> None:
        """Training starts at `step`: records past it are dropped (those steps run again), and the run's earlier
        wall time is carried on. `stream`: the data stream, whose `wait_time_s` is the time spent waiting for it."""
        if self.is_main:
            self.metrics.truncate_after(step if resumed else -1)
        if self.cost:
            self.console.print(
                f"cost: ${self.cost.usd_per_device_hour:.4g} per device-hour x {self.cost.devices} "
                f"devices ({self.cost.source})",
                highlight=False,
            )
        records = self.metrics.records() if resumed else []
        self.elapsed_before = float(records[-1].get("elapsed_s") or 0.0) if records else 0.0
        self.earlier = records[:1]  # the run's first record, written before this process
        self.start, self.stream = step, stream
        self.mix_at = {name: tokens for name, (_, tokens) in stream.mix().items()}  # each source's, at the last record
        self.run_start = time.perf_counter()
        self.interval = Interval(stream.wait_time_s)

    def first_loss(self) -> float:
        """The run's first logged loss: its first record's, written by an earlier process when resumed."""
        first = self.earlier[0]["loss"] if self.earlier else (self.losses or [None])[0]
        return float("nan") if first is None else first  # null in metrics.jsonl: not finite

    def add(self, loss: float, grad_norm: float, seconds: float) -> None:
        self.interval.add(loss, grad_norm, seconds)

    def due(self, step: int, stopping: bool) -> bool:
        return step % self.cfg.train.log_every == 0 or step in (self.start + 1, self.cfg.train.steps) or stopping

    def rolled_back(self, step: int) -> None:
        """The run went back to `step`'s checkpoint: its later records and the interval's steps are dropped."""
        if self.is_main:
            self.metrics.truncate_after(step)
        self.interval.reset(self.stream.wait_time_s)

    def log(self, step: int, lr: float, bad_steps: int, validate=None, extra: dict | None = None) -> None:
        """Write the record of the steps since the last one (with `validate()`'s figures when given, and `extra`
        fields) and print its line."""
        stats = self.interval.close(self.stream.wait_time_s)  # means over the steps since the last record
        record = {**self.record(step, lr, bad_steps, stats), **(extra or {})}
        if validate is not None:
            record.update(validate())
            self.interval.reset(self.stream.wait_time_s)  # the evaluation's time is not a training step's
        if self.is_main:
            self.metrics.write(record)
        self.losses.append(stats["loss"])
        self.console.print(self.line(record, stats), soft_wrap=True, highlight=False)

    def record(self, step: int, lr: float, bad_steps: int, stats: dict) -> dict:
        settings = self.cfg.train
        tokens_per_s, step_time = self.speed(stats)
        elapsed = self.elapsed_before + time.perf_counter() - self.run_start
        projected = projected_seconds(elapsed, step_time, step, settings.steps)
        return {
            "step": step,
            "time": round(time.time(), 3),
            "loss": stats["loss"],
            "grad_norm": stats["grad_norm"],
            "grad_norm_mean": stats["grad_norm_mean"],
            "grad_norm_max": stats["grad_norm_max"],
            "lr": lr,
            "tokens_seen": step * self.tokens_per_step,
            "tokens_per_s": round(tokens_per_s, 1),
            "step_time_s": round(step_time, 4),
            "mfu": round(self.flops_per_token * tokens_per_s / self.peak, 5) if self.peak else None,
            "peak_memory_gb": round(peak_memory_bytes(self.device) / 1e9, 3),
            "data_wait_s": round(stats["data_wait_s"], 4),  # the steps waiting for data
            "bad_steps": bad_steps,  # dropped updates so far in this process (train.on_bad_step)
            "elapsed_s": round(elapsed, 3),
            "projected_time_s": round(projected, 3),
            **(self.cost.figures(elapsed, step * self.tokens_per_step, projected) if self.cost else {}),
            **self.mix(),
        }

    def mix(self) -> dict:
        """The data mix's figures (`mix_figures`) of the interval ending now."""
        mix = self.stream.mix()
        before, self.mix_at = self.mix_at, {name: tokens for name, (_, tokens) in mix.items()}
        return mix_figures(mix, before)

    def speed(self, stats: dict) -> tuple[float, float]:
        """Tokens per second and seconds per step over an interval."""
        return stats["steps"] * self.tokens_per_step / stats["seconds"], stats["seconds"] / stats["steps"]

    def line(self, record: dict, stats: dict) -> str:
        settings, step = self.cfg.train, record["step"]
        tokens_per_s, step_time = self.speed(stats)
        # the first step carries the start-up (data pool, compilation): too early to tell
        eta = "-" if step == self.start + 1 else format_duration(step_time * (settings.steps - step))
        spent = f"  ${record['cost_usd']:,.2f}" if self.cost else ""
        val = "".join(f"  {k} {v:7.4f}" for k, v in record.items() if k.startswith("val_") and k.endswith("loss"))
        mix = mix_text(record) if (len(self.losses) - 1) % MIX_EVERY == 0 or step == settings.steps else ""
        if "moe_imbalance" in record:
            mix += f"  experts: busiest x{record['moe_imbalance']:.2f} of even, {record['moe_dropped']:.1%} dropped"
        return (
            f"step {step:>6}/{settings.steps}  loss {stats['loss']:7.4f}  grad_norm {stats['grad_norm']:6.3f}  "
            f"lr {record['lr']:.2e}  {tokens_per_s:>9,.0f} tok/s  mfu {record['mfu'] or 0:6.2%}  "
            f"eta {eta}{spent}{val}{mix}"
        )

    def close(self) -> None:
        self.metrics.close()
