"""Communication under torchrun: bus bandwidth of the collectives over a sweep of sizes (as nccl-tests report
it), send/recv between every pair of neighbouring ranks, and how much of a collective hides behind concurrent
compute. A debug knob delays one rank's collectives, so that the straggler check can be tested."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hlat.groups import gather_objects
from hlat.measure.options import Options
from hlat.measure.report import CollectiveRow, LinkRow
from hlat.measure.timing import timed, timed_together

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass
class Communication:
    collectives: list[CollectiveRow]
    links: list[LinkRow]
    overlap: float  # rank 0's
    waited_s: float  # this rank's delays before entering the collectives: where a straggler shows
    collective_s: float  # the timed collectives in all, the late rank's delay included: every rank waits for it

    def fields(self) -> dict:
        """The `Measured` fields: [bytes, bus GB/s] per collective, the median link, the overlap."""
        fields = {op: [[r.bytes, r.busbw_gbs] for r in self.collectives if r.op == op] for op in COLLECTIVES}
        return {
            **fields,
            "send_recv": [
                [statistics.median(r.bytes for r in self.links), statistics.median(r.gbs for r in self.links)]
            ],
            "overlap": round(self.overlap, 3),
        }


def measure_communication(
    options: Options, device: torch.device, rank: int, world: int, hosts: list[str]
) -> Communication:
    collectives, waited_s, collective_s = measure_collectives(options, device, rank, world)
    links = measure_links(options, device, rank, world, hosts)
    overlap = gather_objects(measure_overlap(options, device))[0]
    return Communication(collectives, links, overlap, waited_s, collective_s)


def debug_delay(options: Options, rank: int) -> None:
    if rank == options.delay_rank and options.delay_ms > 0:
        time.sleep(options.delay_ms / 1e3)


def measure_collectives(
    options: Options, device: torch.device, rank: int, world: int
) -> tuple[list[CollectiveRow], float, float]:
    """Bus bandwidth of each collective at each size (nccl-tests' busbw: algbw x 2(n-1)/n for all-reduce,
    x (n-1)/n for all-gather and reduce-scatter), the seconds this rank spent before entering them, and the
    seconds the timed collectives took in all."""
    rows, waited_s, collective_s = [], 0.0, 0.0
    for op in COLLECTIVES:
        for size in options.sizes:
            numel = max(world, size // 4 // world * world)
            full, shard = torch.ones(numel, device=device), torch.empty(numel // world, device=device)
            times, waited = collective_times(op, full, shard, options, rank)
            waited_s, collective_s = waited_s + waited, collective_s + sum(times)
            seconds, nbytes = statistics.median(times), numel * 4
            bus_factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
            rows.append(CollectiveRow(op, nbytes, seconds, nbytes / seconds / 1e9, nbytes / seconds / 1e9 * bus_factor))
    return rows, waited_s, collective_s


def collective_times(
    op: str, full: torch.Tensor, shard: torch.Tensor, options: Options, rank: int
) -> tuple[list[float], float]:
    """Seconds of each timed repeat of `op` (after one untimed), every rank starting together, and the seconds
    this rank delayed before entering them all."""
    delays = []

    def run() -> None:
        start = time.perf_counter()
        debug_delay(options, rank)
        delays.append(time.perf_counter() - start)
        if op == "all_reduce":
            dist.all_reduce(full)
        elif op == "all_gather":
            dist.all_gather_single(full, shard)
        else:
            dist.reduce_scatter_single(shard, full)

    return timed_together(run, full.device, options.repeats), sum(delays)


def bulk_size(options: Options) -> int:
    """Bytes of the link and overlap checks: the largest size up to 16 MiB, about one block's gradients (the
    sweep may reach a 200 MB embedding; a message that long would measure how much of the overlap check's
    matmul hides behind it, not the reverse)."""
    return min(max(options.sizes), 2**24)


def measure_links(options: Options, device: torch.device, rank: int, world: int, hosts: list[str]) -> list[LinkRow]:
    """Send/recv between each rank and the next (ring order), one pair at a time, at `bulk_size`."""
    message = torch.ones(bulk_size(options) // 4, device=device)
    nbytes = message.numel() * 4
    own = [statistics.median(link_times(src, (src + 1) % world, message, options, rank)) for src in range(world)]
    # only the pair's two ranks timed the transfer: take the sender's figure
    timed_by = gather_objects(own)
    return [
        LinkRow(
            src,
            (src + 1) % world,
            f"{hosts[src]} -> {hosts[(src + 1) % world]}",
            nbytes,
            timed_by[src][src],
            nbytes / timed_by[src][src] / 1e9,
        )
        for src in range(world)
    ]


def link_times(src: int, dst: int, message: torch.Tensor, options: Options, rank: int) -> list[float]:
    """Seconds of each timed repeat of `message` sent from `src` to `dst` (after one untimed), as this rank saw
    them (meaningful on the pair's two ranks)."""

    def run() -> None:
        if rank == src:
            debug_delay(options, rank)
            dist.send(message, dst)
            dist.recv(message[:1], dst)  # the receiver's acknowledgement: the transfer has landed
        elif rank == dst:
            debug_delay(options, rank)
            dist.recv(message, src)
            dist.send(message[:1], src)

    return timed_together(run, message.device, options.repeats)


def measure_overlap(options: Options, device: torch.device) -> float:
    """Share of an all-reduce hidden behind a concurrent matmul: (t_matmul + t_allreduce - t_both) over the
    shorter of the two, clamped to [0, 1]. The all-reduce runs on the communication stream while the compute
    stream goes on, as `fully_shard` issues the trainer's. On the CPU it is 0 without measuring: there gloo's
    collectives, as fully_shard issues them, block the thread that issued them, so nothing hides (a timing would
    only measure the host's noise)."""
    if device.type == "cpu":
        return 0.0
    square = torch.randn(512, 512, device=device)
    message = torch.ones(bulk_size(options) // 4, device=device)
    matmul_s = timed(lambda: matmuls(square), device, options.repeats)
    all_reduce_s = timed(lambda: dist.all_reduce(message), device, options.repeats)
    both_s = timed(lambda: all_reduce_beside_matmuls(message, square), device, options.repeats)
    return min(1.0, max(0.0, (matmul_s + all_reduce_s - both_s) / min(matmul_s, all_reduce_s)))


def matmuls(square: torch.Tensor) -> None:
    for _ in range(4):
        square @ square


def all_reduce_beside_matmuls(message: torch.Tensor, square: torch.Tensor) -> None:
    work = dist.all_reduce(message, async_op=True)
    matmuls(square)
    work.wait()
