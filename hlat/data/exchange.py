"""What the ranks of a global data stream exchange over their CPU (gloo) side group: the summaries of the rounds
each rank made (so that every rank cuts the same rows), and once per step the token ids of the rows, each
sent by the rank that made its round to the ranks that train on it.

Every function here is a collective: all ranks of the group make the same calls in the same
order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from hlat.groups import rank_and_world


class Segment(NamedTuple):
    """A slice of a round's tokens: [first, end) of round `round` of source `source`."""

    source: int
    round: int
    first: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.first


def exchange_rows(
    rows: list[list[Segment]],
    takers: list[set[int]],
    holder: Callable[[Segment], int],
    tokens: dict[tuple[int, int], np.ndarray],
    group: dist.ProcessGroup | None,
) -> tuple[list[np.ndarray], int]:
    """The rows this rank takes, assembled from their segments, and the bytes it received from other ranks.

    rows[i] are row i's segments; takers[i] the ranks that take row i; holder(segment) the rank that holds a
    segment's round, in `tokens` by (source, round). Every rank computes the same plan from the same rows, so
    all the sizes are known without asking: one all-to-all moves every segment from its holder to its takers."""
    rank, world = rank_and_world(group)
    send: list[list[np.ndarray]] = [[] for _ in range(world)]  # the pieces for each rank, in row order
    receive = [0] * world  # the tokens to come from each rank
    wanted = []  # per row this rank takes: (holder, length) of each of its segments
    for segments, row_takers in zip(rows, takers):
        holders = [holder(segment) for segment in segments]
        for segment, segment_holder in zip(segments, holders):
            if segment_holder == rank:
                piece = tokens[segment.source, segment.round][segment.first : segment.end]
                for taker in row_takers:
                    send[taker].append(piece)
            if rank in row_takers:
                receive[segment_holder] += segment.length
        if rank in row_takers:
            wanted.append([(segment_holder, segment.length) for segment, segment_holder in zip(segments, holders)])
    inbox = _all_to_all(send, receive, group)
    return _assemble(wanted, inbox), 4 * (sum(receive) - receive[rank])


def _all_to_all(send: list[list[np.ndarray]], receive: list[int], group: dist.ProcessGroup | None) -> list[np.ndarray]:
    """What every rank sent this one (send[r]: the pieces for rank r; receive[r]: the tokens from rank r)."""
    sent = [np.concatenate(pieces) if pieces else np.zeros(0, np.int32) for pieces in send]
    if group is None:
        return sent
    out = torch.empty(sum(receive), dtype=torch.int32)
    dist.all_to_all_single(out, torch.from_numpy(np.concatenate(sent)), receive, [len(x) for x in sent], group=group)
    return np.split(out.numpy(), np.cumsum(receive)[:-1])


def _assemble(wanted: list[list[tuple[int, int]]], inbox: list[np.ndarray]) -> list[np.ndarray]:
    """The rows from the pieces received, each rank's pieces in row order."""
    cursor = [0] * len(inbox)
    rows = []
    for segments in wanted:
        pieces = []
        for holder, length in segments:
            pieces.append(inbox[holder][cursor[holder] : cursor[holder] + length])
            cursor[holder] += length
        rows.append(np.concatenate(pieces))
    return rows
