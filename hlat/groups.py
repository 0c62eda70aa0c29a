"""What every package sends besides tensors: a CPU (gloo) side group of all ranks (`side_group`), every rank's
picklable object gathered (`gather_objects`), and one object sent to one rank (`send_object`, `recv_object`).

Side groups carry what stays in host memory whatever the training's backend (the data stream's token ids, the
background writes' collectives, the memory tier's files), each on a group of its own, so that their collectives
never interleave with the training loop's on the default group. A collective on one fails after the training's
`train.collective_timeout_s`, so that a lost peer is found there as soon as in the step's own collectives.
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist


def side_group(timeout_s: float = 600.0) -> dist.ProcessGroup | None:
    """A new gloo group of all ranks (a collective: every rank makes the same side groups in the same order), or None
    in a single process."""
    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def gather_objects(obj, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's picklable `obj`, in rank order, over `group` (the default group when None: a collective of every
    rank); [obj] without a process group."""
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def rank_and_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in `group` and the group's size; (0, 1) in a single process."""
    return (dist.get_rank(group), dist.get_world_size(group)) if group else (0, 1)


def send_object(obj, dst: int, group: dist.ProcessGroup | None) -> list:
    """Start sending a picklable object to rank `dst` (its size, then its bytes); the requests to wait on."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    return [dist.isend(size, dst, group=group), dist.isend(payload, dst, group=group)]


def recv_object(src: int, group: dist.ProcessGroup | None):
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src, group=group)
    return pickle.loads(payload.numpy().tobytes())
