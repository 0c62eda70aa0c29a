"""What the ranks of a global data stream exchange over their CPU (gloo) side group: the summaries of the rounds
each rank made (so that every rank cuts the same rows), and once per step the token ids of the rows, each
sent by the rank that made its round to the ranks that train on it.

Every call here is a collective: all ranks of the group make the same calls in the same order.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

Segment = tuple[int, int, int, int]  # (source, round, first, end): a slice of a round's tokens


def side_group() -> dist.ProcessGroup | None:
    """A gloo group of all ranks (the token ids stay in CPU memory whatever the training backend), or None in
    a single process."""
    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(minutes=10))


def all_gather(obj, group: dist.ProcessGroup | None) -> list:
    """Every rank's `obj`, in rank order."""
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def exchange_rows(rows: list[list[Segment]], takers: list[set[int]], owner, tokens: dict[tuple[int, int], np.ndarray],
                  rank: int, world: int, group: dist.ProcessGroup | None) -> tuple[list[np.ndarray], int]:
    """The rows this rank takes, assembled from their segments, and the bytes it received from other ranks.

    rows[q] are row q's segments; takers[q] the ranks that take row q; owner(segment) the rank that holds a
    segment's round, in `tokens` by (source, round). Every rank computes the same plan from the same rows, so
    all the sizes are known without asking: one all-to-all moves every segment from its owner to its takers."""
    send: list[list[np.ndarray]] = [[] for _ in range(world)]
    receive = [0] * world
    mine = []  # (row, its segments' owners and lengths) for the rows this rank takes
    for q, segments in enumerate(rows):
        owners = [owner(seg) for seg in segments]
        for seg, o in zip(segments, owners):
            if o == rank:
                piece = tokens[seg[0], seg[1]][seg[2] : seg[3]]
                for d in takers[q]:
                    send[d].append(piece)
            if rank in takers[q]:
                receive[o] += seg[3] - seg[2]
        if rank in takers[q]:
            mine.append(list(zip(owners, (seg[3] - seg[2] for seg in segments))))
    sent = [np.concatenate(pieces) if pieces else np.zeros(0, np.int32) for pieces in send]
    if group is None:
        inbox = [sent[0]]
    else:
        out = torch.empty(sum(receive), dtype=torch.int32)
        dist.all_to_all_single(out, torch.from_numpy(np.concatenate(sent)), receive, [len(x) for x in sent],
                               group=group)
        inbox = np.split(out.numpy(), np.cumsum(receive)[:-1])
    cursor = [0] * world
    assembled = []
    for parts in mine:
        pieces = []
        for o, n in parts:
            pieces.append(inbox[o][cursor[o] : cursor[o] + n])
            cursor[o] += n
        assembled.append(np.concatenate(pieces))
    return assembled, 4 * (sum(receive) - receive[rank])
