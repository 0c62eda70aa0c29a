"""One process as one rank of a world that is not there, for `hlat rehearse`: torch's fake process group, whose
collectives complete at once and move no data while every tensor keeps the shape it has on that rank.

The fake process group lives in an internal torch module (the one torchtitan's dry run uses), reached through
`hlat.torch_private`. Its collectives leave every buffer as the local rank's own data would make it (an
all-gather repeats the local shard, a reduce-scatter keeps the local chunk), except a receive, which writes
nothing: `Deliveries` makes every receive deliver ones, so that received activations and gradients are finite
and the pipeline's start-up vote reads what a peer agreeing on static stage shapes sends (1)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hlat.torch_private import TorchDispatchMode, fake_store

FAKE_BACKEND = "fake"
RECEIVES = ("recv_", "recv_any_source_")  # c10d's receive ops


def join_fake_world(rank: int, world_size: int) -> None:
    """Start the default process group as rank `rank` of `world_size` fake ranks."""
    dist.init_process_group(FAKE_BACKEND, store=fake_store(), rank=rank, world_size=world_size)


class Deliveries(TorchDispatchMode):
    """While active, every point-to-point receive fills its buffers with ones."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d" and func.overloadpacket.__name__ in RECEIVES:
            with torch.no_grad():
                for buffer in args[0]:
                    buffer.fill_(1)
        return out
