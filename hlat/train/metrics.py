"""Per-step metrics: throughput, MFU and peak memory, printed and appended to `<run>/metrics.jsonl`."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path

import torch

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


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    # ru_maxrss is in KiB on Linux and bytes on macOS: the whole process's peak resident memory.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1e9 if sys.platform == "darwin" else 1e6)


class MetricsLog:
    """Appends one JSON object per logged step to metrics.jsonl (kept across resumes)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "metrics.jsonl"

    def truncate_after(self, step: int) -> None:
        """On resume, drop records past the checkpoint's step: those steps are about to be run again."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        """Non-finite values (a skipped step's loss) are written as null: bare NaN is not JSON."""
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
