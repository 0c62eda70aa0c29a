"""How every preflight figure is taken: the fastest of a few calls, on each rank, and gathered across ranks; or, for
communication, each of a few calls that every rank starts together."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from hlat.groups import gather_objects


def sync_device(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of fn() after one warm-up call: the least disturbed, on a host
    whose cores other work shares."""
    fn()
    sync_device(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync_device(device)
        times.append(time.perf_counter() - start)
    return min(times)


def timed_together(fn: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of fn() after one untimed, every rank starting each call together (a
    barrier), until the device has finished it."""
    times = []
    for repeat in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        fn()
        sync_device(device)
        if repeat:
            times.append(time.perf_counter() - start)
    return times


def timed_on_every_rank(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The slowest rank's fastest repeat of fn(), every rank timing at once: the trainer's collectives wait for
    the slowest rank."""
    return max(gather_objects(timed(fn, device, repeats)))
