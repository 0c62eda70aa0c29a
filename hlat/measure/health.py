"""Burn-in health: the same numerics on every rank, device memory allocatable, a straggler score per rank, and
the verdict (one line per problem, naming rank and host). A debug knob perturbs one rank's numerics, so that the
check can be tested."""

from __future__ import annotations

import statistics

import torch

from hlat.measure.options import Options
from hlat.measure.report import Report, StragglerRow


def numerics_digest(options: Options, device: torch.device, rank: int) -> float:
    """A matmul of seeded inputs, summed in float64: the same on every healthy rank of one hardware type."""
    generator = torch.Generator(device="cpu").manual_seed(1234)
    a = torch.randn(256, 256, generator=generator).to(device)
    if rank == options.perturb_rank:
        a[0, 0] += 1e-3
    return float((a @ a.T).double().sum().item())


def mismatched_ranks(digests: list[float]) -> list[int]:
    """Ranks whose digest differs from the most common one."""
    majority = statistics.mode(digests)
    return [rank for rank, digest in enumerate(digests) if digest != majority]


def check_memory(options: Options, device: torch.device) -> dict:
    """Allocate memory_fraction of the device's free memory, in 1 GiB pieces (accelerators only)."""
    if device.type == "cpu":
        return {"checked": False, "note": "host memory: not checked"}
    free, total = torch.accelerator.get_memory_info(device)
    want, pieces, allocated = int(free * options.memory_fraction), [], 0
    try:
        while allocated < want:
            pieces.append(torch.empty(min(2**30, want - allocated), dtype=torch.uint8, device=device))
            allocated += pieces[-1].numel()
        return {"checked": True, "allocated_gib": want / 2**30, "total_gib": total / 2**30}
    except torch.OutOfMemoryError:
        return {"checked": True, "failed": True, "allocated_gib": allocated / 2**30, "wanted_gib": want / 2**30}
    finally:
        del pieces


def straggler_scores(timings: list[tuple[float, float, float]], hosts: list[str]) -> list[StragglerRow]:
    """Per rank (its compute, wait and collective seconds), how much it slows the job, as a factor (1 = the
    median rank): the larger of its compute time over the median rank's, and how much longer the collectives
    take for its lateness in entering them (its wait beyond the median rank's, over the collectives' median
    total time). The two are scored apart because on a shared or loaded host compute times vary by more than a
    rank's lateness to the collectives adds to them."""
    compute = statistics.median(t[0] for t in timings)
    wait = statistics.median(t[1] for t in timings)
    collective = statistics.median(t[2] for t in timings)
    return [
        StragglerRow(
            rank,
            hosts[rank],
            compute_s,
            wait_s,
            max(compute_s / compute if compute else 1.0, 1 + (wait_s - wait) / collective if collective else 1.0),
        )
        for rank, (compute_s, wait_s, _) in enumerate(timings)
    ]


def problems(report: Report, threshold: float) -> list[str]:
    """One line per device or link below the threshold, naming rank and host."""
    lines = [
        f"rank {rank} ({report.hosts[rank]}): numerics differ from the other ranks for the same inputs"
        for rank in report.mismatched
    ]
    lines += [
        f"rank {s.rank} ({s.host}): straggler, {s.score:.2f}x the median rank's time"
        for s in report.stragglers
        if s.score > 1 / threshold
    ]
    if report.links:
        median = statistics.median(link.gbs for link in report.links)
        lines += [
            f"link rank {link.src} -> rank {link.dst} ({link.hosts}): {link.gbs:.3g} GB/s, "
            f"{link.gbs / median:.0%} of the median link"
            for link in report.links
            if link.gbs < threshold * median
        ]
    if report.memory.get("failed"):
        lines.append(
            f"rank 0 ({report.hosts[0]}): could allocate only {report.memory['allocated_gib']:.1f} of "
            f"{report.memory['wanted_gib']:.1f} GiB"
        )
    return lines
