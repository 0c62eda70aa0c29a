"""`hlat preflight`: burn-in health checks whose measurements are also what the planner needs to know about the
hardware. One process, or every rank under torchrun (gloo on CPU, NCCL on CUDA):

- compute (`compute.py`): matmuls at the shapes the model runs (per tensor-parallel degree), causal attention
  (SDPA) at the sequence length, the memory-bound operations (norm, activation, rotary, residual, loss) as GB/s;
  on a device with FP8 tensor cores, the blocks' linear layers as torchao's FP8 training runs them (`fp8.py`);
  whole blocks of the real model as the trainer runs them, and the trainer's update (`blocks.py`, over
  `timed_model.py`);
- communication (`collectives.py`): all-reduce, all-gather and reduce-scatter bus bandwidth over a sweep of
  sizes (as nccl-tests report it), send/recv between every pair of neighbouring ranks, and how much of a
  collective hides behind concurrent compute;
- health (`health.py`): bit-identical results on every rank for the same inputs, memory allocatable up to a
  fraction, and a straggler score per rank (its compute time, or its lateness to collectives, against the median
  rank).

Shapes and nominal byte counts come from `hlat.planner.costs`, so the profile written with `--out`
(`report.py`) prices exactly what was measured. Two debug knobs make the health checks testable: one delays a
rank's collectives, one perturbs a rank's numerics. This module runs them in order on every rank."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from hlat.groups import gather_objects
from hlat.measure.blocks import block_fields, block_rows, measure_blocks
from hlat.measure.collectives import measure_communication
from hlat.measure.compute import measure_compute
from hlat.measure.fp8 import measure_fp8
from hlat.measure.health import check_memory, mismatched_ranks, numerics_digest, problems, straggler_scores
from hlat.measure.options import Options
from hlat.measure.report import Report, rounded
from hlat.parallel.config import world_size_from_env
from hlat.parallel.device import pick_device
from hlat.parallel.store import start_process_group
from hlat.profiles import Measured


def run_preflight(options: Options) -> Report:
    """Every measurement and check on this rank (every rank runs it, in the same order); the report is rank 0's
    measurements with every rank's verdicts."""
    device = pick_device(options.device)
    world = world_size_from_env()
    with process_group(device, world):
        return measure_and_check(options, device, dist.get_rank() if world > 1 else 0, world)


@contextlib.contextmanager
def process_group(device: torch.device, world: int) -> Iterator[None]:
    """Under torchrun, a process group for the run unless the caller has one already."""
    started_here = world > 1 and not dist.is_initialized()
    if started_here:
        start_process_group(device, timeout_s=300, bind_device=True)
    try:
        yield
    finally:
        if started_here:
            dist.destroy_process_group()


def measure_and_check(options: Options, device: torch.device, rank: int, world: int) -> Report:
    """Compute, blocks, communication, then the health checks, in an order every rank follows (the collectives
    among them must match); the measurements become the report's `Measured`, rounded."""
    hosts = gather_objects(socket.gethostname())
    report = Report(ranks=world, hosts=hosts, device=str(device))
    start = time.perf_counter()
    report.compute, fields = measure_compute(options, device)
    compute_s = time.perf_counter() - start  # the straggler check's compute time: nothing here waits for a rank
    report.fp8, fp8_rows, fp8_fields = measure_fp8(options, device)
    report.compute += fp8_rows
    fields.update(fp8_fields)
    block_timings, update = measure_blocks(options, device, world)
    report.compute += block_rows(block_timings, update)
    fields.update(block_fields(block_timings, update))
    waited_s = collective_s = 0.0
    if world > 1:
        communication = measure_communication(options, device, rank, world, hosts)
        report.collectives, report.links = communication.collectives, communication.links
        report.overlap = communication.overlap
        waited_s, collective_s = communication.waited_s, communication.collective_s
        fields.update(communication.fields())
    report.memory = check_memory(options, device)
    report.mismatched = mismatched_ranks(gather_objects(numerics_digest(options, device, rank)))
    report.stragglers = straggler_scores(gather_objects((compute_s, waited_s, collective_s)), hosts)
    report.problems = problems(report, options.threshold)
    report.measured = rounded(Measured(**fields, source=measured_source(options, device, hosts)))
    return report


def measured_source(options: Options, device: torch.device, hosts: list[str]) -> str:
    return (
        f"hlat preflight, {len(hosts)} rank(s) on {', '.join(sorted(set(hosts)))} ({device.type}), "
        f"{options.model.preset or options.model.family} seq {options.seq_len} micro-batch {options.micro_batch}"
    )
